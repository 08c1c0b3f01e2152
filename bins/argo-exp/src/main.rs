//! argo-exp: ARGO experiments (to be wired).

fn main() {}
