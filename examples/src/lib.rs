//! Examples live in this folder as `[[example]]` targets; see the README.
