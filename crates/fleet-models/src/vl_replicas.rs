//! Qwen3-VL replicas: batches of chats with images answered by a [`VisionLanguageModel`] in
//! this process or in a child process of its own ([`crate::replica_process`]).
//!
//! ```no_run
//! use fleet_models::placement::{PlacementRequest, PlanMode};
//! use fleet_models::vl_replicas::{load_vl_planned, VlRequest};
//! use fleet_models::{LoadOptions, SamplingParams};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let opts = LoadOptions::default();
//! let request = PlacementRequest::new(PlanMode::DataParallel);
//! let mut replicas = load_vl_planned("Qwen/Qwen3-VL-8B-Instruct", &opts, &request)?;
//! let image = std::sync::Arc::new(image::open("edit.png").expect("an image"));
//! let messages = serde_json::json!([{"role": "user", "content": [
//!     {"type": "image"}, {"type": "text", "text": "Describe the image."}]}]);
//! let batch = vec![VlRequest::greedy(messages, vec![image], 64)];
//! let outcomes = replicas[0].generate(&batch)?;
//! # Ok(()) }
//! ```
//!
//! The first replica is loaded in the calling process; with several GPU replicas (and a
//! program that called [`crate::replica_process::serve_if_replica_worker`]) the others run in
//! child processes, as [`crate::placement::Replicas`] does for text models. Each
//! [`VlReplica`] is driven by one caller thread (e.g. one worker of fleet-dist's replica pool):
//! callers that share a queue of batches get the data parallelism.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use image::DynamicImage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::placement::{plan_on_this_machine, PlacementRequest};
use crate::replica_process::{use_processes, ReplicaKind, ReplicaProcess};
use crate::{
    DeviceLocation, DeviceMap, GenerationOutput, GenerationRequest, LoadOptions, ModelError,
    ModelSource, Qwen3VlConfig, Result, SamplingParams, VisionLanguageModel,
};

/// One chat with images to continue.
#[derive(Debug, Clone)]
pub struct VlRequest {
    /// transformers' message list: `{"role": "system"|"user"|"assistant", "content": text or
    /// a list of `{"type": "image"}` / `{"type": "text", "text": …}` parts}`.
    pub messages: Value,
    /// The images of the image parts, in order.
    pub images: Vec<Arc<DynamicImage>>,
    /// The most tokens to generate.
    pub max_new_tokens: usize,
    /// Greedy (the default) or seeded sampling.
    pub sampling: SamplingParams,
    /// Stop when the generated text contains any of these.
    pub stop_strings: Vec<String>,
}

impl VlRequest {
    /// A greedy request of at most `max_new_tokens` tokens.
    pub fn greedy(messages: Value, images: Vec<Arc<DynamicImage>>, max_new_tokens: usize) -> Self {
        VlRequest {
            messages,
            images,
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            stop_strings: Vec::new(),
        }
    }
}

/// What became of one request of a batch: its output, or why it alone failed (its prompt
/// could not be built, it is too long for the model).
pub type VlOutcome = std::result::Result<GenerationOutput, String>;

/// Generates a batch on a model of this process: each request is checked to fit the model
/// ([`crate::qwen3_vl::VlProcessor::length`]: its M-RoPE positions from the images' sizes, the
/// computation a job can run up front without weights) and its prompt built (chat template,
/// image preprocessing); the ones that fit and build are generated as one left-padded batch.
/// One outcome per request, in order (`Err` for a request that cannot be judged); `Err` when
/// the batch as a whole failed.
pub fn generate_vl(model: &VisionLanguageModel, batch: &[VlRequest]) -> Result<Vec<VlOutcome>> {
    use rayon::prelude::*;
    let mut outcomes: Vec<Option<VlOutcome>> = vec![None; batch.len()];
    let mut prompts = Vec::with_capacity(batch.len());
    let mut requests = Vec::with_capacity(batch.len());
    let mut index = Vec::with_capacity(batch.len());
    // Requests are built in parallel: preprocessing a 1024x1024 image takes tens of
    // milliseconds of one core, and a batch holds dozens of images.
    let built: Vec<Result<crate::VlPrompt>> = batch
        .par_iter()
        .map(|r| {
            // The length first, from the images' sizes: a request too long for the model is
            // refused before its pixels are preprocessed.
            let sizes: Vec<(usize, usize)> = r
                .images
                .iter()
                .map(|img| (img.height() as usize, img.width() as usize))
                .collect();
            model
                .processor
                .length(&r.messages, &sizes, r.max_new_tokens)?
                .check()?;
            let images: Vec<DynamicImage> = r.images.iter().map(|a| (**a).clone()).collect();
            model.prompt(&r.messages, &images)
        })
        .collect();
    for ((i, r), built) in batch.iter().enumerate().zip(built) {
        match built {
            Ok(p) => {
                requests.push(GenerationRequest {
                    prompt_ids: p.ids.clone(),
                    max_new_tokens: r.max_new_tokens,
                    sampling: r.sampling.clone(),
                    stop_strings: r.stop_strings.clone(),
                });
                prompts.push(p);
                index.push(i);
            }
            Err(e) => outcomes[i] = Some(Err(format!("request {i}: {e}"))),
        }
    }
    if !prompts.is_empty() {
        let out = model.generate(&prompts, &requests, None)?;
        for (i, o) in index.into_iter().zip(out) {
            outcomes[i] = Some(Ok(o));
        }
    }
    Ok(outcomes
        .into_iter()
        .map(|o| o.expect("every request has an outcome"))
        .collect())
}

/// A [`VlRequest`] on the wire to a worker: its images as raw RGB8 files in a [`Spool`]
/// (the preprocessing starts with the same conversion, so the worker sees exactly these
/// pixels). PNG over the pipe cost the worker's GPU about a second per batch of 32 images of
/// 1024 px (encode, base64, JSON, decode); a file of raw pixels is a copy to memory.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireVlRequest {
    messages: Value,
    images: Vec<WireImage>,
    max_new_tokens: usize,
    sampling: SamplingParams,
    stop_strings: Vec<String>,
}

/// One image on the wire: the spool file of its RGB8 pixels, row-major.
#[derive(Debug, Serialize, Deserialize)]
struct WireImage {
    path: PathBuf,
    width: u32,
    height: u32,
}

/// The files of one batch's images for a worker: in /dev/shm (memory) where it exists, else in
/// the temp directory. The worker removes each file once read; whatever is left (a worker that
/// died first) is removed when the spool is dropped.
pub(crate) struct Spool {
    dir: PathBuf,
    files: Mutex<Vec<PathBuf>>,
}

impl Spool {
    pub(crate) fn new() -> Self {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        Spool {
            dir,
            files: Mutex::new(Vec::new()),
        }
    }

    /// Writes one image's pixels to a new file.
    fn put(&self, rgb: &image::RgbImage) -> Result<PathBuf> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!("fleet-vl-{}-{n}.rgb", std::process::id()));
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.clone());
        std::fs::write(&path, rgb.as_raw()).map_err(|e| {
            ModelError::Replicas(format!(
                "writing an image for a replica process to {}: {e}",
                path.display()
            ))
        })?;
        Ok(path)
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        for f in self
            .files
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl WireVlRequest {
    pub(crate) fn from_request(r: &VlRequest, spool: &Spool) -> Result<Self> {
        let mut images = Vec::with_capacity(r.images.len());
        for img in &r.images {
            let rgb = img.to_rgb8();
            images.push(WireImage {
                path: spool.put(&rgb)?,
                width: rgb.width(),
                height: rgb.height(),
            });
        }
        Ok(WireVlRequest {
            messages: r.messages.clone(),
            images,
            max_new_tokens: r.max_new_tokens,
            sampling: r.sampling.clone(),
            stop_strings: r.stop_strings.clone(),
        })
    }

    /// Reads (and removes) the image files.
    pub(crate) fn into_request(self) -> std::result::Result<VlRequest, String> {
        let mut images = Vec::with_capacity(self.images.len());
        let mut failed = None;
        for (k, w) in self.images.iter().enumerate() {
            let read = std::fs::read(&w.path);
            let _ = std::fs::remove_file(&w.path);
            let img = read
                .map_err(|e| format!("image {k}: reading {}: {e}", w.path.display()))
                .and_then(|bytes| {
                    let want = w.width as usize * w.height as usize * 3;
                    if bytes.len() != want {
                        return Err(format!(
                            "image {k}: {} holds {} bytes, not the {want} of {}x{} RGB pixels",
                            w.path.display(),
                            bytes.len(),
                            w.width,
                            w.height
                        ));
                    }
                    image::RgbImage::from_raw(w.width, w.height, bytes)
                        .map(DynamicImage::ImageRgb8)
                        .ok_or_else(|| format!("image {k}: {}x{} pixels", w.width, w.height))
                });
            match img {
                Ok(img) => images.push(Arc::new(img)),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(VlRequest {
            messages: self.messages,
            images,
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling,
            stop_strings: self.stop_strings,
        })
    }
}

/// One Qwen3-VL replica: loaded in this process, or in a child process of its own.
pub struct VlReplica {
    inner: Inner,
    devices: String,
    map: String,
}

enum Inner {
    Local(Box<VisionLanguageModel>),
    Process(ReplicaProcess),
}

impl VlReplica {
    fn new(inner: Inner, map: &DeviceMap) -> Self {
        let devices: Vec<String> = map.devices().iter().map(|d| d.to_string()).collect();
        VlReplica {
            inner,
            devices: devices.join(","),
            map: map.to_string(),
        }
    }

    /// The devices it uses, e.g. `cuda:0` or `cuda:0,cuda:1` (for progress bars).
    pub fn devices(&self) -> &str {
        &self.devices
    }

    /// Its device map, e.g. `embed=cuda:1 layers[0..36]=cuda:1 head=cuda:1`.
    pub fn device_map(&self) -> &str {
        &self.map
    }

    /// The worker's pid, when the replica runs in a child process.
    pub fn pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::Local(_) => None,
            Inner::Process(p) => Some(p.pid()),
        }
    }

    /// `cuda:0` for a replica here, `cuda:1 (pid 4242)` for one in a child process.
    pub fn name(&self) -> String {
        match self.pid() {
            Some(pid) => format!("{} (pid {pid})", self.devices),
            None => self.devices.clone(),
        }
    }

    /// The model, when the replica lives in this process.
    pub fn local(&self) -> Option<&VisionLanguageModel> {
        match &self.inner {
            Inner::Local(m) => Some(m),
            Inner::Process(_) => None,
        }
    }

    /// Whether it runs in a child process.
    pub fn in_process(&self) -> bool {
        matches!(self.inner, Inner::Process(_))
    }

    /// Generates one batch ([`generate_vl`]), here or in the replica's process: one outcome
    /// per request, in order; `Err` when the whole batch failed (or the process stopped).
    pub fn generate(&mut self, batch: &[VlRequest]) -> Result<Vec<VlOutcome>> {
        match &mut self.inner {
            Inner::Local(m) => generate_vl(m, batch),
            Inner::Process(p) => p.generate_vl(batch),
        }
    }
}

/// Loads one replica of the Qwen3-VL checkpoint `spec` per device map (`opts.device_map` is
/// ignored). The first is loaded in this process; the others in child processes when the
/// program opted in and they use GPUs (`FLEET_REPLICA_PROCESSES=1` forces processes for CPU
/// replicas too, `0` keeps every replica here; see [`crate::replica_process`]). Processes
/// load in parallel with the first replica.
pub fn load_vl_replicas(
    spec: &str,
    opts: &LoadOptions,
    maps: &[DeviceMap],
) -> Result<Vec<VlReplica>> {
    if maps.is_empty() {
        return Err(ModelError::Replicas(
            "no device map given: one per replica".into(),
        ));
    }
    let in_processes = use_processes(maps);
    let mut processes = Vec::new();
    if in_processes {
        for (i, map) in maps.iter().enumerate().skip(1) {
            tracing::info!("starting judge replica {i} on {map} in a process of its own");
            processes.push((
                map,
                ReplicaProcess::spawn(ReplicaKind::VisionLanguage, spec, opts, map)?,
            ));
        }
    }
    let local_maps = if in_processes { &maps[..1] } else { maps };
    let mut out = Vec::with_capacity(maps.len());
    for (i, map) in local_maps.iter().enumerate() {
        tracing::info!("loading judge replica {i} on {map}");
        let opts = LoadOptions {
            device_map: Some(map.clone()),
            ..opts.clone()
        };
        let model = VisionLanguageModel::load(spec, &opts)?;
        out.push(VlReplica::new(Inner::Local(Box::new(model)), map));
    }
    for (map, mut p) in processes {
        p.ready()?;
        out.push(VlReplica::new(Inner::Process(p), map));
    }
    Ok(out)
}

/// The device maps of the replicas of Qwen3-VL checkpoint `spec` on this machine: the
/// planner's ([`plan_on_this_machine`]: `--gpu-mode`, `--gpu-ids`, `max_memory`; one replica
/// per GPU, or per GPU group when the model does not fit one), with the plan as text; one CPU
/// map (and `None`) on a machine without GPUs.
pub fn vl_device_maps(
    spec: &str,
    opts: &LoadOptions,
    request: &PlacementRequest,
) -> Result<(Vec<DeviceMap>, Option<String>)> {
    match plan_on_this_machine(spec, opts, request)? {
        Some(plan) => Ok((
            plan.replicas.iter().map(|r| r.device_map.clone()).collect(),
            Some(plan.to_string()),
        )),
        None => {
            let source = ModelSource::parse(spec, opts.revision.as_deref())?;
            let config = source.resolve(&opts.hub)?.config;
            let layers = Qwen3VlConfig::from_file(&config)?.text.num_hidden_layers;
            Ok((vec![DeviceMap::single(DeviceLocation::Cpu, layers)], None))
        }
    }
}

/// Plans on this machine ([`vl_device_maps`]) and loads every replica
/// ([`load_vl_replicas`]); one CPU replica on a machine without GPUs.
pub fn load_vl_planned(
    spec: &str,
    opts: &LoadOptions,
    request: &PlacementRequest,
) -> Result<Vec<VlReplica>> {
    let (maps, plan) = vl_device_maps(spec, opts, request)?;
    match plan {
        Some(p) => tracing::info!("placement plan:\n{p}"),
        None => tracing::warn!("no GPU visible: one judge replica on the CPU"),
    }
    load_vl_replicas(spec, opts, &maps)
}
