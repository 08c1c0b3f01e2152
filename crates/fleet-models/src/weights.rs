//! Weights by name: memory-mapped safetensors shards, or random tensors of the right shape
//! (benchmarks build real shapes directly on the GPU without a checkpoint).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

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

/// The source of a model's tensors.
pub enum Weights {
    /// Memory-mapped safetensors shards.
    Safetensors(SafetensorsWeights),
    /// Random tensors made on the target device (for benchmarks of real shapes).
    Random {
        /// Seed of each device's generator.
        seed: u64,
    },
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
            Weights::Safetensors(st) => st.get(name, shape, dtype, device),
            Weights::Random { seed: _ } => {
                let t = match init {
                    Init::Normal(std) => {
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
            Weights::Random { .. } => true,
        }
    }

    /// Seeds the random generator of every device that will receive random weights.
    pub fn seed_devices(&self, devices: &[&Device]) -> Result<()> {
        if let Weights::Random { seed } = self {
            for d in devices {
                d.set_seed(*seed)?;
            }
        }
        Ok(())
    }
}

/// Shards of one checkpoint, mapped into memory.
pub struct SafetensorsWeights {
    mmaped: MmapedSafetensors,
    /// Tensor name → shard, for error messages.
    index: HashMap<String, PathBuf>,
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
        Ok(SafetensorsWeights { mmaped, index })
    }

    fn get(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
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
        let t = self
            .mmaped
            .load(name, device)
            .map_err(|e| ModelError::BadWeights {
                path: file.clone(),
                message: format!("cannot load tensor `{name}`: {e}"),
            })?;
        if t.dims() != shape {
            return Err(ModelError::BadWeights {
                path: file.clone(),
                message: format!(
                    "tensor `{name}` has shape {:?} but config.json implies {shape:?}; the \
                     config and weights are from different models",
                    t.dims()
                ),
            });
        }
        Ok(t.to_dtype(dtype)?)
    }
}

/// Reads a shard's header and checks that the file holds every byte the header promises.
/// Returns the tensor names.
fn check_shard(path: &Path) -> Result<Vec<String>> {
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
}
