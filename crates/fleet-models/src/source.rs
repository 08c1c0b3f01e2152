//! Where a checkpoint comes from: a local directory or a Hugging Face hub repository.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// A checkpoint's location as the user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory holding config.json, safetensors and tokenizer files.
    Local(PathBuf),
    /// A hub repository such as `Qwen/Qwen2.5-7B-Instruct`, at a revision (branch, tag or commit).
    Hub {
        /// `owner/name`.
        repo: String,
        /// Branch, tag or commit; `main` by default.
        revision: String,
    },
}

impl ModelSource {
    /// An existing directory is local; anything else of the form `owner/name` is a hub repo.
    pub fn parse(spec: &str, revision: Option<&str>) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(ModelSource::Local(path.to_path_buf()));
        }
        let looks_like_repo = spec.split('/').count() == 2
            && !spec.starts_with('.')
            && !spec.starts_with('/')
            && spec.split('/').all(|p| !p.is_empty());
        if looks_like_repo {
            Ok(ModelSource::Hub {
                repo: spec.to_string(),
                revision: revision.unwrap_or("main").to_string(),
            })
        } else {
            Err(ModelError::Source {
                model: spec.to_string(),
                message: "no such directory, and not a hub id of the form owner/name".into(),
            })
        }
    }

    /// Finds (and for the hub, downloads or looks up in the cache) the checkpoint's files.
    pub fn resolve(&self, hub: &HubOptions) -> Result<CheckpointFiles> {
        self.resolve_weights(hub, Weights::Required, Weights::Required)
    }

    /// The checkpoint's files for planning: as [`ModelSource::resolve`], but the weights are
    /// neither required nor downloaded. A local directory's safetensors are listed when present
    /// (a plan then reads their headers); otherwise `weights` is empty and a plan sizes the
    /// model from config.json.
    pub fn resolve_for_plan(&self, hub: &HubOptions) -> Result<CheckpointFiles> {
        self.resolve_weights(hub, Weights::IfPresent, Weights::Skip)
    }

    /// The files, with the weights as `local` says for a directory and `hub` for a hub id.
    fn resolve_weights(
        &self,
        hub: &HubOptions,
        local: Weights,
        remote: Weights,
    ) -> Result<CheckpointFiles> {
        match self {
            ModelSource::Local(dir) => {
                resolve_with(&LocalDir(dir.clone()), &dir.display().to_string(), local)
            }
            ModelSource::Hub { repo, revision } => {
                let fetcher = HubRepo::new(repo, revision, hub)?;
                resolve_with(&fetcher, &format!("{repo}@{revision}"), remote)
            }
        }
    }

    /// Only the checkpoint's config.json (no weights are fetched), for planning. A path to a
    /// `.json` file is taken as the config itself.
    pub fn config_file(spec: &str, revision: Option<&str>, hub: &HubOptions) -> Result<PathBuf> {
        let path = Path::new(spec);
        if path.is_file() {
            return Ok(path.to_path_buf());
        }
        let missing = |origin: &str| ModelError::MissingFile {
            path: PathBuf::from(origin).join("config.json"),
            hint: "a checkpoint directory needs the config.json it was published with".into(),
        };
        match ModelSource::parse(spec, revision)? {
            ModelSource::Local(dir) => LocalDir(dir.clone())
                .get("config.json")?
                .ok_or_else(|| missing(&dir.display().to_string())),
            ModelSource::Hub { repo, revision } => HubRepo::new(&repo, &revision, hub)?
                .get("config.json")?
                .ok_or_else(|| missing(&format!("{repo}@{revision}"))),
        }
    }

    /// A short name for logs and result files.
    pub fn id(&self) -> String {
        match self {
            ModelSource::Local(p) => p.display().to_string(),
            ModelSource::Hub { repo, revision } if revision == "main" => repo.clone(),
            ModelSource::Hub { repo, revision } => format!("{repo}@{revision}"),
        }
    }
}

/// How to reach the hub. [`HubOptions::from_env`] reads the variables `huggingface_hub` reads.
#[derive(Debug, Clone, Default)]
pub struct HubOptions {
    /// Cache root (`$HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    pub cache_dir: Option<PathBuf>,
    /// Never touch the network (`HF_HUB_OFFLINE=1`): files must already be in the cache.
    pub offline: bool,
}

impl HubOptions {
    /// From `HF_HOME` and `HF_HUB_OFFLINE`.
    pub fn from_env() -> Self {
        let offline = std::env::var("HF_HUB_OFFLINE")
            .map(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            })
            .unwrap_or(false);
        HubOptions {
            cache_dir: None,
            offline,
        }
    }
}

/// The files of one checkpoint on local disk.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// Where it came from, for messages.
    pub origin: String,
    /// config.json.
    pub config: PathBuf,
    /// The safetensors shards, in index order.
    pub weights: Vec<PathBuf>,
    /// tokenizer.json, if the checkpoint has one.
    pub tokenizer: Option<PathBuf>,
    /// tokenizer_config.json (holds the chat template), if any.
    pub tokenizer_config: Option<PathBuf>,
    /// generation_config.json, if any.
    pub generation_config: Option<PathBuf>,
    /// preprocessor_config.json (a vision-language checkpoint's image processor), if any.
    pub preprocessor_config: Option<PathBuf>,
    /// A chat template file of its own (`chat_template.jinja`, else the processor's
    /// `chat_template.json`), which takes precedence over tokenizer_config.json's.
    pub chat_template: Option<PathBuf>,
}

/// What makes a checkpoint behave as it does, by content: stored in the manifests of runs that
/// use it, so a resume with other weights, config or tokenizer is refused even when the path
/// is the same (and accepted when the same files sit elsewhere).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointIdentity {
    /// Digest of the safetensors shards' bytes ([`fleet_data::digest::files_digest`]).
    pub weights_digest: String,
    /// Digest of config.json.
    pub config_digest: String,
    /// Digest of tokenizer.json, tokenizer_config.json (the chat template),
    /// generation_config.json and preprocessor_config.json, those the checkpoint has.
    pub tokenizer_digest: String,
}

impl CheckpointFiles {
    /// The checkpoint's [`CheckpointIdentity`]. Reads every weight byte (the shards on parallel
    /// threads): seconds for a 7B checkpoint.
    pub fn identity(&self) -> Result<CheckpointIdentity> {
        let digest = |files: &[PathBuf]| {
            fleet_data::digest::files_digest(files).map_err(|(path, e)| ModelError::io(path, e))
        };
        let tokenizer_files: Vec<PathBuf> = [
            &self.tokenizer,
            &self.tokenizer_config,
            &self.generation_config,
            &self.preprocessor_config,
            &self.chat_template,
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        Ok(CheckpointIdentity {
            weights_digest: digest(&self.weights)?,
            config_digest: digest(std::slice::from_ref(&self.config))?,
            tokenizer_digest: digest(&tokenizer_files)?,
        })
    }
}

/// Something that can hand out a checkpoint's files by name.
trait FileFetcher {
    /// `Ok(None)` when the file does not exist in the checkpoint.
    fn get(&self, name: &str) -> Result<Option<PathBuf>>;
}

struct LocalDir(PathBuf);

impl FileFetcher for LocalDir {
    fn get(&self, name: &str) -> Result<Option<PathBuf>> {
        let p = self.0.join(name);
        Ok(p.is_file().then_some(p))
    }
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// What [`resolve_with`] does about the weights.
#[derive(Clone, Copy, PartialEq)]
enum Weights {
    /// Every shard must be there (fetched from the hub if need be).
    Required,
    /// Listed when they are all there; none when any is missing.
    IfPresent,
    /// Not looked for (nothing is downloaded).
    Skip,
}

fn resolve_with(f: &dyn FileFetcher, origin: &str, want: Weights) -> Result<CheckpointFiles> {
    let config = f
        .get("config.json")?
        .ok_or_else(|| ModelError::MissingFile {
            path: PathBuf::from(origin).join("config.json"),
            hint: "a checkpoint directory needs the config.json it was published with".into(),
        })?;
    let weights = match want {
        Weights::Required => find_weights(f, origin)?,
        Weights::IfPresent => match find_weights(f, origin) {
            Err(ModelError::MissingFile { .. }) => Vec::new(),
            found => found?,
        },
        Weights::Skip => Vec::new(),
    };
    Ok(CheckpointFiles {
        origin: origin.to_string(),
        config,
        weights,
        tokenizer: f.get("tokenizer.json")?,
        tokenizer_config: f.get("tokenizer_config.json")?,
        generation_config: f.get("generation_config.json")?,
        preprocessor_config: f.get("preprocessor_config.json")?,
        chat_template: match f.get("chat_template.jinja")? {
            Some(p) => Some(p),
            None => f.get("chat_template.json")?,
        },
    })
}

/// The safetensors shards: every file the index names, or the single file.
fn find_weights(f: &dyn FileFetcher, origin: &str) -> Result<Vec<PathBuf>> {
    if let Some(index) = f.get(INDEX)? {
        let mut files = Vec::new();
        for name in shard_names(&index)? {
            let path = f.get(&name)?.ok_or_else(|| ModelError::MissingFile {
                path: PathBuf::from(origin).join(&name),
                hint: format!("{INDEX} names this shard; download the complete checkpoint"),
            })?;
            files.push(path);
        }
        Ok(files)
    } else if let Some(single) = f.get(SINGLE)? {
        Ok(vec![single])
    } else {
        Err(ModelError::MissingFile {
            path: PathBuf::from(origin).join(SINGLE),
            hint: format!(
                "neither {SINGLE} nor {INDEX} found; fleet loads safetensors weights only"
            ),
        })
    }
}

/// The distinct shard file names of a `model.safetensors.index.json`, sorted.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::BadJson {
        path: index.to_path_buf(),
        message: e.to_string(),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::BadJson {
            path: index.to_path_buf(),
            message: "field `weight_map` (tensor name -> shard file) is missing".into(),
        })?;
    let names: BTreeSet<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    if names.is_empty() {
        return Err(ModelError::BadJson {
            path: index.to_path_buf(),
            message: "`weight_map` names no shard files".into(),
        });
    }
    for n in &names {
        if n.contains('/') || n.contains("..") {
            return Err(ModelError::BadJson {
                path: index.to_path_buf(),
                message: format!("shard name `{n}` must be a plain file name"),
            });
        }
    }
    Ok(names.into_iter().collect())
}

/// A hub repository's files through the hub cache (and, online, the hub API).
pub(crate) struct HubRepo {
    model: String,
    repo: hf_hub::Repo,
    cache: hf_hub::Cache,
    /// Online: the client and the repo's file list (one API call), so absent optional files
    /// are known without a failed download.
    online: Option<(hf_hub::api::sync::ApiRepo, BTreeSet<String>)>,
}

impl HubRepo {
    /// Opens `repo_id@revision`; online this lists the repository once.
    pub(crate) fn new(repo_id: &str, revision: &str, opts: &HubOptions) -> Result<Self> {
        let model = format!("{repo_id}@{revision}");
        let cache = match &opts.cache_dir {
            Some(dir) => hf_hub::Cache::new(dir.clone()),
            None => hf_hub::Cache::from_env(),
        };
        let repo = hf_hub::Repo::with_revision(
            repo_id.to_string(),
            hf_hub::RepoType::Model,
            revision.to_string(),
        );
        let online = if opts.offline {
            None
        } else {
            let fail = |what: &str, e: &dyn std::fmt::Display| ModelError::Source {
                model: model.clone(),
                message: format!(
                    "{what}: {e}; check the repo id and revision, your network and HF_TOKEN for \
                     gated models, or set HF_HUB_OFFLINE=1 to use the local cache"
                ),
            };
            let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
                .with_progress(true)
                .build()
                .map_err(|e| fail("cannot start the hub client", &e))?
                .repo(repo.clone());
            let info = api
                .info()
                .map_err(|e| fail("cannot list the repository", &e))?;
            let files = info.siblings.into_iter().map(|s| s.rfilename).collect();
            Some((api, files))
        };
        Ok(HubRepo {
            model,
            repo,
            cache,
            online,
        })
    }

    /// The file from the cache, else (online, when the repository lists it) downloaded;
    /// `Ok(None)` when the repository has no such file, or offline when it is not cached.
    pub(crate) fn optional(&self, name: &str) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cache.repo(self.repo.clone()).get(name) {
            return Ok(Some(p));
        }
        let Some((api, files)) = &self.online else {
            return Ok(None);
        };
        if !files.contains(name) {
            return Ok(None);
        }
        api.get(name).map(Some).map_err(|e| ModelError::Source {
            model: self.model.clone(),
            message: format!("downloading {name} failed: {e}"),
        })
    }
}

impl FileFetcher for HubRepo {
    fn get(&self, name: &str) -> Result<Option<PathBuf>> {
        let found = self.optional(name)?;
        // Offline, optional files may be absent; the checkpoint's core must be cached.
        let core = name == "config.json" || name == SINGLE || name.ends_with(".safetensors");
        if found.is_none() && self.online.is_none() && core {
            return Err(ModelError::Source {
                model: self.model.clone(),
                message: format!(
                    "{name} is not in the hub cache at {} and HF_HUB_OFFLINE is set; \
                     download the model once with network access (unset HF_HUB_OFFLINE), \
                     or pass a local directory with --model",
                    self.cache.path().display()
                ),
            });
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn parses_sources() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        assert_eq!(
            ModelSource::parse(d, None).unwrap(),
            ModelSource::Local(dir.path().into())
        );
        assert_eq!(
            ModelSource::parse("Qwen/Qwen2.5-7B", Some("v1")).unwrap(),
            ModelSource::Hub {
                repo: "Qwen/Qwen2.5-7B".into(),
                revision: "v1".into()
            }
        );
        let e = ModelSource::parse("./nope/nope", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such directory"), "{e}");
    }

    #[test]
    fn resolves_sharded_local_dir_and_reports_missing_shard() {
        let dir = tempfile::tempdir().unwrap();
        write(&dir.path().join("config.json"), "{}");
        write(
            &dir.path().join(INDEX),
            r#"{"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}"#,
        );
        write(&dir.path().join("model-00001-of-00002.safetensors"), "");
        let e = ModelSource::Local(dir.path().into())
            .resolve(&HubOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model-00002-of-00002.safetensors") && e.contains("is missing"),
            "{e}"
        );
        write(&dir.path().join("model-00002-of-00002.safetensors"), "");
        let files = ModelSource::Local(dir.path().into())
            .resolve(&HubOptions::default())
            .unwrap();
        assert_eq!(files.weights.len(), 2);
        assert!(files.weights[0].ends_with("model-00001-of-00002.safetensors"));
        assert!(files.tokenizer.is_none());
    }

    #[test]
    fn missing_weights_and_config_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = ModelSource::Local(dir.path().into())
            .resolve(&HubOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json"), "{e}");
        write(&dir.path().join("config.json"), "{}");
        let e = ModelSource::Local(dir.path().into())
            .resolve(&HubOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.safetensors"), "{e}");
    }

    /// The offline path reads the same cache layout huggingface_hub writes.
    #[test]
    fn offline_hub_reads_the_cache_and_names_a_miss() {
        let cache = tempfile::tempdir().unwrap();
        let repo_dir = cache.path().join("models--org--tiny");
        write(&repo_dir.join("refs/main"), "abc123");
        let snap = repo_dir.join("snapshots/abc123");
        write(&snap.join("config.json"), "{}");
        write(&snap.join("model.safetensors"), "");
        write(&snap.join("tokenizer.json"), "{}");
        let opts = HubOptions {
            cache_dir: Some(cache.path().into()),
            offline: true,
        };
        let files = ModelSource::parse("org/tiny", None)
            .unwrap()
            .resolve(&opts)
            .unwrap();
        assert_eq!(files.config, snap.join("config.json"));
        assert_eq!(files.weights, vec![snap.join("model.safetensors")]);
        assert!(files.tokenizer.is_some() && files.generation_config.is_none());

        let e = ModelSource::parse("org/absent", None)
            .unwrap()
            .resolve(&opts)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("HF_HUB_OFFLINE") && e.contains("org/absent"),
            "{e}"
        );
    }
}
