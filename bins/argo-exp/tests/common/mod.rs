//! Running the argo-exp binary from the tests, and the tiny set-up of the real-run tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs argo-exp with `args`.
pub fn argo_exp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_argo-exp"))
        .args(args)
        .output()
        .expect("argo-exp runs")
}

/// The commit `--version` names (the one the binary was built from).
#[allow(dead_code)]
pub fn built_commit() -> String {
    let out = argo_exp(&["--version"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split("(commit ")
        .nth(1)
        .and_then(|t| t.split(')').next())
        .unwrap_or_else(|| panic!("no commit in --version: {text}"))
        .to_string()
}

/// The repository root.
#[allow(dead_code)]
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// stdout of a run that must succeed (panics with both streams otherwise).
#[allow(dead_code)]
pub fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// stderr of a run that must fail (panics if it succeeded or panicked).
#[allow(dead_code)]
pub fn fails(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected a failure; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// A real run on the tiny fixtures: a two-document index, a three-question JSONL dataset and
/// prompts with short replies (the tiny model writes noise; short replies keep the CPU quick).
#[allow(dead_code)]
pub struct TinyRun {
    /// The temporary directory holding it all.
    pub tmp: tempfile::TempDir,
    /// The documents ingested.
    pub docs: PathBuf,
    /// The index.
    pub index: PathBuf,
    /// The tiny BERT embedder.
    pub embedder: PathBuf,
    /// The dataset.
    pub data: PathBuf,
    /// The prompts.
    pub prompts: PathBuf,
    /// The tiny Qwen2 checkpoint.
    pub model: PathBuf,
}

#[allow(dead_code)]
impl TinyRun {
    /// Writes the documents, dataset and prompts; ingests the index.
    pub fn new() -> TinyRun {
        let tmp = tempfile::tempdir().unwrap();
        let docs = tmp.path().join("docs");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(
            docs.join("e2.txt"),
            "The E2 interface connects the near-RT RIC to E2 nodes.",
        )
        .unwrap();
        std::fs::write(
            docs.join("a1.md"),
            "The A1 interface carries policies to the near-RT RIC.",
        )
        .unwrap();
        let data = tmp.path().join("questions.jsonl");
        let mut lines = String::new();
        for i in 0..3 {
            lines.push_str(&format!(
                "{{\"id\": \"t{i}\", \"question\": \"Which interface links the RIC to E2 nodes ({i})?\", \"options\": [\"A1\", \"E2\", \"O1\"], \"answer\": 2}}\n"
            ));
        }
        std::fs::write(&data, lines).unwrap();
        let prompts = tmp.path().join("prompts.toml");
        let shipped = std::fs::read_to_string(repo().join("configs/argo_prompts.toml")).unwrap();
        let short = shipped
            .replace("max_new_tokens = 48", "max_new_tokens = 4")
            .replace("max_new_tokens = 128", "max_new_tokens = 4")
            .replace("max_new_tokens = 64", "max_new_tokens = 6");
        std::fs::write(&prompts, short).unwrap();
        let run = TinyRun {
            index: tmp.path().join("index"),
            embedder: repo().join("tests/fixtures/bert-tiny-st"),
            model: repo().join("tests/fixtures/qwen2-tiny"),
            docs,
            data,
            prompts,
            tmp,
        };
        let out = ok(&run.ingest(&[]));
        assert!(
            out.contains("2 added") && out.contains("2 chunks in all"),
            "{out}"
        );
        run
    }

    /// `argo-exp ingest` of the documents into the index, with `extra` flags.
    pub fn ingest(&self, extra: &[&str]) -> Output {
        let mut args = vec![
            "ingest",
            "--docs",
            self.docs.to_str().unwrap(),
            "--index",
            self.index.to_str().unwrap(),
            "--embedder",
            self.embedder.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        argo_exp(&args)
    }

    /// The flags of `argo-exp compare` on the tiny set-up writing to `out`: 3 questions,
    /// three strategies, step cap 3.
    pub fn compare_args(&self, out: &Path) -> Vec<String> {
        [
            "compare",
            "--model",
            self.model.to_str().unwrap(),
            "--dtype",
            "f32",
            "--dataset",
            self.data.to_str().unwrap(),
            "--n-questions",
            "3",
            "--strategies",
            "argo,fixed-k:1,always-reason",
            "--step-cap",
            "3",
            "--prompts",
            self.prompts.to_str().unwrap(),
            "--index",
            self.index.to_str().unwrap(),
            "--embedder",
            self.embedder.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Runs argo-exp with `args` where the value after each flag in `set` is replaced (or the
    /// flag and value appended when absent).
    pub fn run_with(&self, args: &[String], set: &[(&str, &str)]) -> Output {
        let mut args = args.to_vec();
        for (flag, value) in set {
            match args.iter().position(|a| a == flag) {
                Some(i) if value.is_empty() => {
                    args.remove(i);
                    args.remove(i);
                }
                Some(i) => args[i + 1] = value.to_string(),
                None if value.is_empty() => {}
                None => {
                    args.push(flag.to_string());
                    args.push(value.to_string());
                }
            }
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        argo_exp(&refs)
    }
}
