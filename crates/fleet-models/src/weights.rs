//! Weights by name: memory-mapped safetensors shards, or random tensors of the right shape
//! (benchmarks build real shapes directly on the GPU without a checkpoint).
//!
//! Loading guards against a silently wrong model: every tensor read is checked for its shape
//! and for NaN/infinite values (after the cast to the compute dtype), and the names read are
//! recorded so the model can refuse a checkpoint holding tensors its config.json does not
//! account for ([`Weights::check_unread`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{ModelError, Result};

/// How a weight should be initialised when it is made up rather than loaded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal(0, std), as transformers initialises linear and embedding weights.
    Normal(f64),
    /// All ones (RMSNorm scales).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// transformers' `initializer_range`: the std of random linear and embedding weights.
pub(crate) const INIT_STD: f64 = 0.02;

/// Reads the tensors of one device in one dtype: the one weight loader of every model (text
/// blocks, experts, the vision tower), over a checkpoint, random weights or a trainer's tensors.
pub(crate) struct Loader<'a> {
    pub(crate) weights: &'a Weights,
    pub(crate) dtype: DType,
    pub(crate) device: &'a Device,
}

impl Loader<'_> {
    /// The tensor `name` of `shape` (`init` when the weights are random).
    pub(crate) fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        self.weights.get(name, shape, init, self.dtype, self.device)
    }

    /// `{name}.weight` `[out, in]` and, with `bias`, `{name}.bias` `[out]`.
    pub(crate) fn linear(
        &self,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let w = self.tensor(
            &format!("{name}.weight"),
            &[out_dim, in_dim],
            Init::Normal(INIT_STD),
        )?;
        let b = if bias {
            Some(self.tensor(&format!("{name}.bias"), &[out_dim], Init::Zeros)?)
        } else {
            None
        };
        Ok((w, b))
    }
}

/// The source of a model's tensors.
pub enum Weights {
    /// Memory-mapped safetensors shards.
    Safetensors(SafetensorsWeights),
    /// Random tensors made on the target device (for benchmarks of real shapes).
    Random {
        /// With each tensor's name, the key of its draw (a CPU generator's stream, or the
        /// GPU's generator seeded for that tensor): the same seed gives the same weights
        /// whatever the load order and, on one kind of device, whatever the placement (a
        /// model split over two GPUs has the weights it has on one).
        seed: u64,
    },
    /// Tensors held in memory by name: a trained model's master weights, from which the blocks
    /// are built as from a checkpoint (tracked tensors keep the graph to their `Var`s).
    Tensors(HashMap<String, Tensor>),
}

impl Weights {
    /// Maps the shards after checking that each one is complete.
    pub fn from_safetensors(files: &[PathBuf]) -> Result<Self> {
        Ok(Weights::Safetensors(SafetensorsWeights::open(files)?))
    }

    /// The tensor `name` with `shape`, as `dtype`, on `device`. `init` is used for random weights.
    pub fn get(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        match self {
            Weights::Safetensors(st) => st.get(name, Some(shape), dtype, device),
            Weights::Tensors(map) => {
                let t = map.get(name).ok_or_else(|| ModelError::BadWeights {
                    path: PathBuf::new(),
                    message: format!(
                        "tensor `{name}` is not among the {} trained tensors; they come from a \
                         checkpoint of another architecture",
                        map.len()
                    ),
                })?;
                if t.dims() != shape {
                    return Err(ModelError::BadWeights {
                        path: PathBuf::new(),
                        message: format!(
                            "trained tensor `{name}` has shape {:?} but the config implies {shape:?}",
                            t.dims()
                        ),
                    });
                }
                let t = t.to_dtype(dtype)?;
                Ok(if t.device().same_device(device) {
                    t
                } else {
                    t.to_device(device)?
                })
            }
            Weights::Random { seed } => {
                let t = match init {
                    // candle's CPU generator cannot be seeded: draw from one of fleet's own.
                    Init::Normal(std) if device.is_cpu() => {
                        random_normal_cpu(*seed, name, shape, std)?.to_dtype(dtype)?
                    }
                    Init::Normal(std) => {
                        device.set_seed(crate::ops::splitmix(*seed ^ name_hash(name)))?;
                        Tensor::randn(0f32, std as f32, shape, device)?.to_dtype(dtype)?
                    }
                    Init::Ones => Tensor::ones(shape, dtype, device)?,
                    Init::Zeros => Tensor::zeros(shape, dtype, device)?,
                };
                Ok(t)
            }
        }
    }

    /// Whether the checkpoint holds `name` (random weights hold everything).
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Weights::Safetensors(st) => st.index.contains_key(name),
            Weights::Tensors(map) => map.contains_key(name),
            Weights::Random { .. } => true,
        }
    }

    /// The stored shape of `name` (`None` when absent, and for random weights).
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Weights::Safetensors(st) => {
                st.index.get(name)?;
                st.mmaped.get(name).ok().map(|v| v.shape().to_vec())
            }
            Weights::Tensors(map) => map.get(name).map(|t| t.dims().to_vec()),
            Weights::Random { .. } => None,
        }
    }

    /// The names of the tensors held, sorted (`None` for random weights, which have none).
    pub fn names(&self) -> Option<Vec<String>> {
        let mut names: Vec<String> = match self {
            Weights::Safetensors(st) => st.index.keys().cloned().collect(),
            Weights::Tensors(map) => map.keys().cloned().collect(),
            Weights::Random { .. } => return None,
        };
        names.sort();
        Some(names)
    }

    /// The tensor `name` whatever its shape, as `dtype`, on `device` (what a trainer loads as
    /// its master weights; the model's own loading checks shapes against the config). Random
    /// weights have no tensors by name.
    pub fn load_any(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        match self {
            Weights::Safetensors(st) => st.get(name, None, dtype, device),
            Weights::Tensors(map) => match map.get(name) {
                Some(t) => Ok(t.to_dtype(dtype)?.to_device(device)?),
                None => Err(ModelError::BadInput(format!("no tensor `{name}`"))),
            },
            Weights::Random { .. } => Err(ModelError::BadInput(format!(
                "random weights have no tensor `{name}` to load by name"
            ))),
        }
    }

    /// The checkpoint's tensors that no [`Weights::get`] has read yet, sorted (none for random
    /// weights). After a model is built from the weights, these are what it does not use.
    pub fn unread_tensors(&self) -> Vec<String> {
        match self {
            Weights::Safetensors(st) => {
                let read = st.read.lock().unwrap_or_else(|e| e.into_inner());
                let mut names: Vec<String> = st
                    .index
                    .keys()
                    .filter(|n| !read.contains(*n))
                    .cloned()
                    .collect();
                names.sort();
                names
            }
            _ => Vec::new(),
        }
    }

    /// The shard that holds `name` (`None` for random weights or a name not in the checkpoint).
    pub fn shard_of(&self, name: &str) -> Option<&Path> {
        match self {
            Weights::Safetensors(st) => st.index.get(name).map(|p| p.as_path()),
            _ => None,
        }
    }

    /// Errors when the checkpoint holds tensors no [`Weights::get`] has read, once the model is
    /// built: the config.json it was built from does not describe these weights. `classify`
    /// says which unread names are harmless (see [`Unread`]); the error names the others (the
    /// first few, grouped by layer, and their count), followed by `hint` (the likely cause,
    /// from the model that knows its config).
    pub fn check_unread(
        &self,
        classify: impl Fn(&str) -> Unread,
        hint: impl FnOnce(&[String]) -> String,
    ) -> Result<()> {
        let mut refused = Vec::new();
        let mut warned: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
        for name in self.unread_tensors() {
            match classify(&name) {
                Unread::Refuse => refused.push(name),
                Unread::Ignore => tracing::debug!("checkpoint tensor `{name}` is not used"),
                Unread::Warn(why) => warned.entry(why).or_default().push(name),
            }
        }
        for (why, names) in warned {
            tracing::warn!(
                "{} checkpoint tensor(s) not used: {}; {why}",
                names.len(),
                summarize_names(&names)
            );
        }
        if refused.is_empty() {
            return Ok(());
        }
        Err(ModelError::BadWeights {
            path: self
                .shard_of(&refused[0])
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            message: format!(
                "{} tensor(s) in the checkpoint are not used by the model its config.json \
                 describes: {}; {}",
                refused.len(),
                summarize_names(&refused),
                hint(&refused)
            ),
        })
    }
}

/// What to make of a checkpoint tensor that the model did not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// The config does not describe the weights: loading fails.
    Refuse,
    /// Harmless and not worth a word (transformers drops it silently: a buffer the model
    /// recomputes, or a part the task does not use).
    Ignore,
    /// Harmless but worth a warning naming it, with this reason (transformers ignores or warns).
    Warn(&'static str),
}

/// The first few of `names` (sorted) and how many there are: tensors of one numbered block
/// collapsed to `block.*` with their count, `model.layers.1.* (12), model.layers.2.* (12), lm_head.weight`.
pub(crate) fn summarize_names(names: &[String]) -> String {
    const SHOWN: usize = 5;
    // Groups in order of first appearance, keyed by the prefix up to a numeric path component:
    // (key, count, first name).
    let mut groups: Vec<(String, usize, &str)> = Vec::new();
    for name in names {
        let parts: Vec<&str> = name.split('.').collect();
        let key = match parts
            .iter()
            .position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        {
            Some(i) if i + 1 < parts.len() => format!("{}.*", parts[..=i].join(".")),
            _ => name.clone(),
        };
        match groups.iter_mut().find(|(k, ..)| *k == key) {
            Some((_, n, _)) => *n += 1,
            None => groups.push((key, 1, name)),
        }
    }
    let shown: Vec<String> = groups
        .iter()
        .take(SHOWN)
        .map(|(key, n, first)| match n {
            1 => format!("`{first}`"),
            _ => format!("`{key}` ({n})"),
        })
        .collect();
    let rest = groups.len().saturating_sub(SHOWN);
    if rest > 0 {
        format!("{} and {rest} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

/// The generator of the random tensor `name`: keyed by `seed`, on a stream picked by the
/// FNV-1a hash of the name.
fn tensor_rng(seed: u64, name: &str) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(name_hash(name));
    rng
}

/// FNV-1a of a tensor's name: the part of a random tensor's key that its name gives.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Normal(0, std) values for the tensor `name`, from a ChaCha generator keyed by `seed` on a
/// stream chosen by the name: the same seed gives the same weights whatever the load order.
/// Blocks of values are drawn on all cores, each from its own position in the stream (one
/// 32-bit word per value), so the values do not depend on the number of threads either.
fn random_normal_cpu(seed: u64, name: &str, shape: &[usize], std: f64) -> Result<Tensor> {
    use rayon::prelude::*;
    /// Values per block (even: Box-Muller makes them in pairs).
    const BLOCK: usize = 1 << 16;
    let n: usize = shape.iter().product();
    let rng = tensor_rng(seed, name);
    let std = std as f32;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(b, block)| {
            let mut rng = rng.clone();
            rng.set_word_pos((b * BLOCK) as u128);
            // Box-Muller: two normal values per pair of uniforms.
            for pair in block.chunks_mut(2) {
                let u1: f32 = 1.0 - rng.random::<f32>(); // (0, 1], so ln is finite
                let u2: f32 = rng.random::<f32>();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
                pair[0] = r * c;
                if let Some(x) = pair.get_mut(1) {
                    *x = r * s;
                }
            }
        });
    Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
}

/// NaN or infinite values found in a tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NonFinite {
    /// How many values are NaN or infinite.
    pub count: usize,
    /// Row-major index of the first one.
    pub first: usize,
    /// Its value (NaN, inf or -inf).
    pub value: f32,
}

/// The NaN/infinite values of `t` (`None` when every value is finite, or the dtype is not a
/// float). On the CPU the values are scanned in place. Elsewhere the tensor is summed on its
/// device (one pass, no temporary; a NaN or infinity makes the sum non-finite) and only a
/// tensor whose sum is not finite is copied to the host to be located (a sum of finite values
/// that overflows is found finite there).
pub(crate) fn non_finite(t: &Tensor) -> Result<Option<NonFinite>> {
    if !t.dtype().is_float() || t.elem_count() == 0 {
        return Ok(None);
    }
    if t.device().is_cpu() {
        scan_cpu(t)
    } else if sum_is_finite(t)? {
        Ok(None)
    } else {
        scan_cpu(&t.to_device(&Device::Cpu)?)
    }
}

/// Whether the sum of `t` (a float tensor) is finite, reduced on its device: rows first, then
/// their sums in f32 (candle reduces to one value in a single thread block, and the total may
/// pass f16's range where no row does).
fn sum_is_finite(t: &Tensor) -> Result<bool> {
    let cols = t.dims().last().copied().unwrap_or(1).max(1);
    let rows = t.elem_count() / cols;
    let sum = if rows > 1 {
        t.reshape((rows, cols))?
            .sum(1)?
            .to_dtype(DType::F32)?
            .sum_all()?
    } else {
        t.sum_all()?.to_dtype(DType::F32)?
    };
    Ok(sum.to_scalar::<f32>()?.is_finite())
}

/// The NaN/infinite values of a float tensor on the CPU, scanned in place.
fn scan_cpu(t: &Tensor) -> Result<Option<NonFinite>> {
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let Some((a, b)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    fn scan<T: Copy>(
        v: &[T],
        finite: impl Fn(T) -> bool,
        f32_of: impl Fn(T) -> f32,
    ) -> Option<NonFinite> {
        const BLOCK: usize = 4096;
        let mut found: Option<NonFinite> = None;
        for (b, block) in v.chunks(BLOCK).enumerate() {
            // A branch-free pass the compiler vectorizes; blocks that fail are searched.
            if block.iter().fold(true, |ok, &x| ok & finite(x)) {
                continue;
            }
            for (i, &x) in block.iter().enumerate() {
                if finite(x) {
                    continue;
                }
                match &mut found {
                    Some(f) => f.count += 1,
                    None => {
                        found = Some(NonFinite {
                            count: 1,
                            first: b * BLOCK + i,
                            value: f32_of(x),
                        })
                    }
                }
            }
        }
        found
    }
    // Finite unless the exponent bits are all ones (inf, NaN), as `is_finite`, on the bits.
    let f32_finite = |x: f32| x.to_bits() & 0x7f80_0000 != 0x7f80_0000;
    let bf16_finite = |x: half::bf16| x.to_bits() & 0x7f80 != 0x7f80;
    let f16_finite = |x: half::f16| x.to_bits() & 0x7c00 != 0x7c00;
    Ok(match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => scan(&v[a..b], f32_finite, |x| x),
        Storage::Cpu(CpuStorage::F64(v)) => scan(&v[a..b], f64::is_finite, |x| x as f32),
        Storage::Cpu(CpuStorage::BF16(v)) => scan(&v[a..b], bf16_finite, |x| x.to_f32()),
        Storage::Cpu(CpuStorage::F16(v)) => scan(&v[a..b], f16_finite, |x| x.to_f32()),
        // Other float types (f8 and the like) through f32.
        _ => {
            drop(storage);
            let v: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            scan(&v, f32::is_finite, |x| x)
        }
    })
}

/// Shards of one checkpoint, mapped into memory.
pub struct SafetensorsWeights {
    mmaped: MmapedSafetensors,
    /// Tensor name → shard, for error messages.
    index: HashMap<String, PathBuf>,
    /// The names read so far (see [`Weights::unread_tensors`]).
    read: Mutex<HashSet<String>>,
}

impl SafetensorsWeights {
    fn open(files: &[PathBuf]) -> Result<Self> {
        let mut index = HashMap::new();
        for f in files {
            for name in check_shard(f)? {
                index.insert(name, f.clone());
            }
        }
        // SAFETY: the files are mapped read-only; fleet never writes checkpoints while reading.
        let mmaped =
            unsafe { MmapedSafetensors::multi(files) }.map_err(|e| ModelError::BadWeights {
                path: files.first().cloned().unwrap_or_default(),
                message: format!("cannot map the shards: {e}"),
            })?;
        Ok(SafetensorsWeights {
            mmaped,
            index,
            read: Mutex::new(HashSet::new()),
        })
    }

    /// `name` as `dtype` on `device`, checked against `shape` when given.
    fn get(
        &self,
        name: &str,
        shape: Option<&[usize]>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let Some(file) = self.index.get(name) else {
            let shards: Vec<_> = self
                .index
                .values()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            return Err(ModelError::BadWeights {
                path: shards.first().map(|p| p.to_path_buf()).unwrap_or_default(),
                message: format!(
                    "tensor `{name}` is not in the checkpoint ({} shard(s)); the checkpoint does not \
                     match its config.json, or a shard is missing",
                    shards.len()
                ),
            });
        };
        self.read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        let t = self
            .mmaped
            .load(name, device)
            .map_err(|e| ModelError::BadWeights {
                path: file.clone(),
                message: format!("cannot load tensor `{name}`: {e}"),
            })?;
        if let Some(shape) = shape.filter(|s| t.dims() != *s) {
            return Err(ModelError::BadWeights {
                path: file.clone(),
                message: format!(
                    "tensor `{name}` has shape {:?} but config.json implies {shape:?}; the \
                     config and weights are from different models",
                    t.dims()
                ),
            });
        }
        let out = t.to_dtype(dtype)?;
        // A NaN or infinity in a weight makes every output it reaches NaN; checked in the
        // compute dtype, so values that overflow it (f16 tops out at 65504) are caught too.
        if let Some(bad) = non_finite(&out)? {
            let in_file = if t.dtype() == dtype {
                Some(bad)
            } else {
                non_finite(&t)?
            };
            let message = match in_file {
                Some(f) => format!(
                    "tensor `{name}` holds {} NaN/infinite value(s) of {} (the first, {}, at \
                     flat index {}); the shard is corrupt or was saved from a diverged model: \
                     download it again or use another checkpoint",
                    f.count,
                    t.elem_count(),
                    f.value,
                    f.first
                ),
                None => format!(
                    "tensor `{name}` is finite as stored ({:?}) but {} value(s) overflow {:?} \
                     (the first at flat index {}); load the model in bf16 or f32",
                    t.dtype(),
                    bad.count,
                    dtype,
                    bad.first
                ),
            };
            return Err(ModelError::BadWeights {
                path: file.clone(),
                message,
            });
        }
        Ok(out)
    }
}

/// Reads a safetensors file's header and checks that the file holds every byte the header
/// promises (a file cut short by a kill or a full disk fails here, before anything is mapped).
/// Returns the tensor names.
pub fn check_shard(path: &Path) -> Result<Vec<String>> {
    let bad = |message: String| ModelError::BadWeights {
        path: path.to_path_buf(),
        message,
    };
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let file_len = f.metadata().map_err(|e| ModelError::io(path, e))?.len();
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes).map_err(|_| {
        bad(format!(
            "the file has {file_len} bytes, too short for a safetensors header; the shard is \
             truncated: download it again"
        ))
    })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > 100_000_000 || 8 + header_len > file_len {
        return Err(bad(format!(
            "header length {header_len} does not fit in the file ({file_len} bytes); the shard is \
             truncated or not safetensors: download it again"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| ModelError::io(path, e))?;
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| {
        bad(format!(
            "the header is not valid JSON ({e}); the shard is corrupt"
        ))
    })?;
    let obj = header
        .as_object()
        .ok_or_else(|| bad("the header is not a JSON object".into()))?;
    let mut data_end = 0u64;
    let mut names = Vec::with_capacity(obj.len());
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(|e| e.as_u64())
            .ok_or_else(|| bad(format!("tensor `{name}` has no data_offsets in the header")))?;
        data_end = data_end.max(end);
        names.push(name.clone());
    }
    let needed = 8 + header_len + data_end;
    if file_len < needed {
        return Err(bad(format!(
            "the shard is truncated: its header needs {needed} bytes but the file has {file_len}; \
             download it again"
        )));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_shard(path: &Path) {
        let t = Tensor::arange(0f32, 6., &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        candle_core::safetensors::save(&HashMap::from([("w".to_string(), t)]), path).unwrap();
    }

    #[test]
    fn loads_and_checks_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        write_shard(&p);
        let w = Weights::from_safetensors(std::slice::from_ref(&p)).unwrap();
        let t = w
            .get("w", &[2, 3], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap();
        assert_eq!(
            t.to_vec2::<f32>().unwrap(),
            vec![vec![0., 1., 2.], vec![3., 4., 5.]]
        );
        let e = w
            .get("w", &[3, 2], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shape [2, 3]") && e.contains("[3, 2]"), "{e}");
        let e = w
            .get("nope", &[1], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`nope`") && e.contains("model.safetensors"),
            "{e}"
        );
    }

    #[test]
    fn truncated_shard_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model-00001-of-00002.safetensors");
        write_shard(&p);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        let e = Weights::from_safetensors(std::slice::from_ref(&p))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("model-00001-of-00002.safetensors") && e.contains("truncated"),
            "{e}"
        );
        std::fs::write(&p, &bytes[..5]).unwrap();
        let e = Weights::from_safetensors(&[p]).err().unwrap().to_string();
        assert!(e.contains("truncated"), "{e}");
    }

    /// `[1, 2, bad, 4, bad]` in `dtype`, as a 1-D or `[5, 1]` tensor.
    fn with_bad(bad: f32, dtype: DType, rows: bool) -> Tensor {
        let t = Tensor::new(&[1f32, 2., bad, 4., bad], &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        if rows {
            t.reshape((5, 1)).unwrap()
        } else {
            t
        }
    }

    #[test]
    fn non_finite_values_are_counted_and_located() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for rows in [false, true] {
                let ok = with_bad(3.0, dtype, rows);
                assert_eq!(non_finite(&ok).unwrap(), None, "{dtype:?}");
                assert!(sum_is_finite(&ok).unwrap());
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let t = with_bad(bad, dtype, rows);
                    let f = non_finite(&t).unwrap().unwrap();
                    assert_eq!((f.count, f.first), (2, 2), "{dtype:?} {bad}");
                    assert_eq!(f.value.is_nan(), bad.is_nan());
                    // The reduction the GPUs run finds it too.
                    assert!(!sum_is_finite(&t).unwrap(), "{dtype:?} {bad}");
                }
            }
        }
        // Past the first block of the scan, and in a strided view.
        let mut v = vec![0.5f32; 10_000];
        v[9_000] = f32::NAN;
        let t = Tensor::from_vec(v, (100, 100), &Device::Cpu).unwrap();
        assert_eq!(non_finite(&t).unwrap().unwrap().first, 9_000);
        assert_eq!(non_finite(&t.t().unwrap()).unwrap().unwrap().first, 90);
        // Integers are never reported.
        let ids = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        assert_eq!(non_finite(&ids).unwrap(), None);
    }

    #[test]
    fn nan_weights_are_named_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let t = Tensor::new(&[[1f32, f32::NAN], [3., 4.]], &Device::Cpu).unwrap();
        let big = Tensor::new(&[1e6f32, 1.0], &Device::Cpu).unwrap();
        candle_core::safetensors::save(
            &HashMap::from([("w".to_string(), t), ("big".to_string(), big)]),
            &p,
        )
        .unwrap();
        let w = Weights::from_safetensors(std::slice::from_ref(&p)).unwrap();
        let e = w
            .get("w", &[2, 2], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("`w` holds 1 NaN/infinite value(s) of 4"),
            "{e}"
        );
        w.get("big", &[2], Init::Zeros, DType::BF16, &Device::Cpu)
            .unwrap();
        let e = w
            .get("big", &[2], Init::Zeros, DType::F16, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("overflow F16") && e.contains("bf16 or f32"),
            "{e}"
        );
    }

    #[test]
    fn unread_tensors_are_tracked_and_summarized() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let z = || Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let mut tensors = HashMap::new();
        for name in [
            "a.weight",
            "layers.0.x",
            "layers.1.x",
            "layers.1.y",
            "layers.2.x",
            "extra.buffer",
        ] {
            tensors.insert(name.to_string(), z());
        }
        candle_core::safetensors::save(&tensors, &p).unwrap();
        let w = Weights::from_safetensors(std::slice::from_ref(&p)).unwrap();
        w.get("a.weight", &[2], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap();
        w.get("layers.0.x", &[2], Init::Zeros, DType::F32, &Device::Cpu)
            .unwrap();
        assert_eq!(
            w.unread_tensors(),
            ["extra.buffer", "layers.1.x", "layers.1.y", "layers.2.x"]
        );
        assert_eq!(
            summarize_names(&w.unread_tensors()),
            "`extra.buffer`, `layers.1.*` (2), `layers.2.x`"
        );
        let e = w
            .check_unread(|_| Unread::Refuse, |_| "the hint".into())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors: 4 tensor(s)") && e.ends_with("the hint"),
            "{e}"
        );
        w.check_unread(
            |n| match n {
                "extra.buffer" => Unread::Ignore,
                _ => Unread::Warn("why"),
            },
            |_| unreachable!("nothing refused"),
        )
        .unwrap();
        let many: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
        assert_eq!(
            summarize_names(&many),
            "`t0`, `t1`, `t2`, `t3`, `t4` and 3 more"
        );
        // Random weights hold every name and leave none unread.
        assert!(Weights::Random { seed: 0 }.unread_tensors().is_empty());
    }

    #[test]
    fn random_cpu_weights_depend_on_seed_and_name_only() {
        let get = |seed: u64, name: &str| -> Vec<f32> {
            Weights::Random { seed }
                .get(
                    name,
                    &[3, 1000],
                    Init::Normal(0.5),
                    DType::F32,
                    &Device::Cpu,
                )
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let a = get(1, "w");
        assert_eq!(a, get(1, "w"));
        assert_ne!(a, get(2, "w"));
        assert_ne!(a, get(1, "v"));
        // Normal(0, 0.5): sample mean and standard deviation.
        let n = a.len() as f32;
        let mean = a.iter().sum::<f32>() / n;
        let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n).sqrt();
        assert!(
            mean.abs() < 0.05 && (std - 0.5).abs() < 0.03,
            "{mean} {std}"
        );
        // Blocks continue the stream: a tensor past one block equals a sequential draw.
        let mut rng = tensor_rng(1, "w");
        let big = random_normal_cpu(1, "w", &[(1 << 16) + 3], 1.0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for i in [0usize, 1 << 16] {
            rng.set_word_pos(i as u128);
            let u1: f32 = 1.0 - rng.random::<f32>();
            let u2: f32 = rng.random::<f32>();
            let want = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
            assert_eq!(big[i], want, "value {i}");
        }
        // Odd sizes.
        let w = Weights::Random { seed: 3 };
        let t = w
            .get("odd", &[7], Init::Normal(0.02), DType::BF16, &Device::Cpu)
            .unwrap();
        assert_eq!(t.dims(), [7]);
    }
}
