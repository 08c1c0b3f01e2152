//! Host values cast and concatenated into one device tensor, in parallel, and on a GPU
//! through a reused buffer of page-locked memory that the GPU copies from while the host goes
//! on (`FLEET_PINNED_UPLOAD=0`: from pageable memory, as before).
//!
//! Why: from pageable memory (a `Vec`) the driver stages the copy through its own pinned
//! buffers and returns only once it has read the source, so the host waits for the transfer.
//! At the start of a prompt pass nothing is queued on the GPU, so the GPU waits too: the
//! judge's `vision.pixels` stage (the pixel values of a pass, ~75 MB in bf16 at 1024 px) was
//! ~7% of its prefill with the GPU idle (docs/benchmarks.md, 2026-11-28g). From pinned memory
//! the copy is queued like a kernel and the host goes on to queue the vision tower's work:
//! +4–7% samples/s on both judges (2026-11-28h, docs/benchmarks.md).
//! (`FLEET_PROFILE=1` synchronizes after every stage, which hides exactly this: measure it by
//! throughput, or with `FLEET_PROFILE=events`.)

#[cfg(feature = "cuda")]
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// `parts` concatenated, each value mapped through `cast`, written into `out` (exactly the
/// parts' total length) in parallel chunks: each output element depends on its input element
/// alone, so the order of the chunks does not matter.
pub(crate) fn cast_concat_into<T: Send>(
    parts: &[&[f32]],
    cast: impl Fn(f32) -> T + Sync,
    out: &mut [T],
) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    assert_eq!(
        out.len(),
        total,
        "cast_concat_into: the output must hold the parts"
    );
    let mut rest = out;
    let mut pairs = Vec::new();
    for part in parts {
        let (head, tail) = rest.split_at_mut(part.len());
        pairs.extend(head.chunks_mut(CHUNK).zip(part.chunks(CHUNK)));
        rest = tail;
    }
    pairs.into_par_iter().for_each(|(dst, src)| {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = cast(v);
        }
    });
}

/// [`cast_concat_into`] a new vector.
pub(crate) fn cast_concat<T: Send + Sync + Copy + Default>(
    parts: &[&[f32]],
    cast: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(total);
    out.par_extend(rayon::iter::repeat_n(T::default(), total));
    cast_concat_into(parts, cast, &mut out);
    out
}

/// Whether [`Uploads::cast_concat`] goes through pinned memory on a GPU:
/// on unless `FLEET_PINNED_UPLOAD=0`.
#[cfg(feature = "cuda")]
static PINNED: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_PINNED_UPLOAD", true);

/// Test switch for [`PINNED`]: `Some(on)` forces it, `None` leaves it to the environment.
#[cfg(all(test, feature = "cuda"))]
fn set_pinned(on: Option<bool>) {
    PINNED.force(on);
}

/// Uploads of cast host values (see the module docs). Holds at most one pinned buffer, grown to
/// the largest upload so far, for the CUDA context it was made in (an upload to another
/// context makes a new one); a model keeps one for its encoder's device.
#[derive(Default)]
pub struct Uploads {
    /// The buffer between uploads. An upload takes it out and puts it back, so that the lock
    /// is not held across the parallel cast (a rayon task waiting on it could deadlock).
    #[cfg(feature = "cuda")]
    staging: Mutex<Option<Staging>>,
}

/// The pinned buffer and the event after the last copy out of it.
#[cfg(feature = "cuda")]
struct Staging {
    buf: candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u8>,
    /// Recorded on the stream after the last copy from `buf`: the host waits for it before
    /// writing or freeing `buf` (cudarc records nothing for it: its slice's own event is
    /// never recorded, and fleet turns cudarc's event tracking off, see
    /// `device::skip_event_tracking`).
    copied: candle_core::cuda_backend::cudarc::driver::CudaEvent,
}

#[cfg(feature = "cuda")]
impl Drop for Staging {
    /// Waits for the last copy before `buf` is freed (`cuMemFreeHost` does not wait for
    /// copies still queued).
    fn drop(&mut self) {
        let _ = self.copied.synchronize();
    }
}

impl std::fmt::Debug for Uploads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uploads").finish_non_exhaustive()
    }
}

impl Uploads {
    /// No buffer yet: the first pinned upload allocates it.
    pub fn new() -> Self {
        Self::default()
    }

    /// `parts` concatenated and cast to `dtype` (f32, bf16 or f16: the same rounding as
    /// candle's `to_dtype`), as a `[rows, cols]` tensor on `dev`. The cast runs on the host in
    /// parallel, so half the bytes of f32 go up for a half dtype.
    ///
    /// # Errors
    /// Another dtype, parts that do not hold `rows x cols` values, or the device's error.
    pub fn cast_concat(
        &self,
        parts: &[&[f32]],
        dtype: DType,
        (rows, cols): (usize, usize),
        dev: &Device,
    ) -> Result<Tensor> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total != rows * cols {
            return Err(ModelError::BadInput(format!(
                "an upload of [{rows}, {cols}] got {total} values"
            )));
        }
        match dtype {
            DType::BF16 => self.cast_as(parts, half::bf16::from_f32, (rows, cols), dev),
            DType::F16 => self.cast_as(parts, half::f16::from_f32, (rows, cols), dev),
            DType::F32 => self.cast_as(parts, |v| v, (rows, cols), dev),
            other => Err(ModelError::BadInput(format!(
                "an upload of f32 values cast to {other:?}: only f32, bf16 and f16 are taken"
            ))),
        }
    }

    fn cast_as<T: Upload>(
        &self,
        parts: &[&[f32]],
        cast: impl Fn(f32) -> T + Sync,
        shape: (usize, usize),
        dev: &Device,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = dev {
            if PINNED.on() {
                return self.pinned(parts, cast, shape, cuda);
            }
        }
        Ok(Tensor::from_vec(cast_concat(parts, cast), shape, dev)?)
    }

    /// The pinned path: cast into the buffer, one asynchronous copy, an event after it.
    /// Nothing to copy, or a buffer the driver will not pin, takes the pageable path.
    #[cfg(feature = "cuda")]
    fn pinned<T: Upload>(
        &self,
        parts: &[&[f32]],
        cast: impl Fn(f32) -> T + Sync,
        (rows, cols): (usize, usize),
        cuda: &candle_core::CudaDevice,
    ) -> Result<Tensor> {
        use candle_core::cuda_backend::WrapErr;
        let dev = Device::Cuda(cuda.clone());
        let total = rows * cols;
        if total == 0 {
            return Ok(Tensor::from_vec(Vec::<T>::new(), (rows, cols), &dev)?);
        }
        let bytes = total * std::mem::size_of::<T>();
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        let taken = self
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // The last copy out of the buffer must be done before it is written (or, dropped
        // here when too small or of another context, freed: `Staging`'s drop waits).
        let mut s = match taken {
            Some(s) if s.buf.len() >= bytes && std::sync::Arc::ptr_eq(s.buf.context(), ctx) => {
                s.copied.synchronize().w()?;
                s
            }
            old => {
                drop(old);
                // A quarter more than asked, so that slightly larger passes reuse it.
                // SAFETY: zeroed below before anything reads it.
                let buf = match unsafe { ctx.alloc_pinned::<u8>(bytes + bytes / 4) } {
                    Ok(buf) => buf,
                    Err(e) => {
                        tracing::warn!(
                            "FLEET_PINNED_UPLOAD: {} MB of pinned memory refused ({e}); this \
                             upload goes from pageable memory",
                            (bytes + bytes / 4) >> 20
                        );
                        return Ok(Tensor::from_vec(
                            cast_concat(parts, cast),
                            (rows, cols),
                            &dev,
                        )?);
                    }
                };
                let mut s = Staging {
                    copied: ctx.new_event(None).w()?,
                    buf,
                };
                s.buf.as_mut_slice().w()?.fill(0);
                s
            }
        };
        let base = s.buf.as_mut_ptr().w()?;
        // SAFETY: the buffer is page-aligned (cuMemHostAlloc), at least `bytes` long and
        // initialized (zeroed when made), `T` is plain data (f32, bf16, f16), and no copy reads
        // it now (its last one synchronized above).
        let host = unsafe { std::slice::from_raw_parts_mut(base.cast::<T>(), total) };
        cast_concat_into(parts, cast, host);
        // SAFETY: written in full by the copy queued next, before anything reads it.
        let mut dst = unsafe { cuda.alloc::<T>(total) }?;
        // A plain slice to cudarc (no stream sync); the driver sees page-locked memory and
        // queues the copy without waiting for it.
        stream.memcpy_htod(&*host, &mut dst).w()?;
        if let Err(e) = s.copied.record(&stream).w() {
            // Without the event nothing would say when the copy is done: wait for it here.
            let _ = stream.synchronize();
            return Err(e.into());
        }
        *self
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(s);
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(
                dst,
                cuda.clone(),
            )),
            (rows, cols),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

/// What [`Uploads`] casts to: candle's dtypes that a device buffer holds as plain data.
#[cfg(feature = "cuda")]
trait Upload:
    candle_core::WithDType
    + candle_core::cuda_backend::CudaDType
    + candle_core::cuda_backend::cudarc::driver::DeviceRepr
    + Default
{
}
#[cfg(feature = "cuda")]
impl<
        T: candle_core::WithDType
            + candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr
            + Default,
    > Upload for T
{
}
#[cfg(not(feature = "cuda"))]
trait Upload: candle_core::WithDType + Default {}
#[cfg(not(feature = "cuda"))]
impl<T: candle_core::WithDType + Default> Upload for T {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel cast of the pixel rows is the serial concatenation cast element by
    /// element: parts of other lengths (one longer than a chunk, one empty), order kept.
    #[test]
    fn cast_concat_is_the_concatenation_cast_in_order() {
        let a: Vec<f32> = (0..(1 << 16) + 37)
            .map(|i| (i as f32).sin() * 3.3)
            .collect();
        let b: Vec<f32> = Vec::new();
        let c: Vec<f32> = (0..1000).map(|i| 1.0 / (i as f32 + 0.7)).collect();
        let parts: Vec<&[f32]> = vec![&a, &b, &c];
        let got = cast_concat(&parts, half::bf16::from_f32);
        let want: Vec<half::bf16> = a
            .iter()
            .chain(&b)
            .chain(&c)
            .map(|&v| half::bf16::from_f32(v))
            .collect();
        assert_eq!(got, want);
        assert_eq!(cast_concat(&parts, |v| v), [a, b, c].concat());
    }

    #[test]
    fn an_upload_is_candle_s_cast_of_the_concatenation() {
        let a: Vec<f32> = (0..96).map(|i| i as f32 * 1.1e-3 - 0.05).collect();
        let b: Vec<f32> = (0..48).map(|i| (i as f32).cos()).collect();
        let up = Uploads::new();
        let f32s =
            Tensor::from_vec([a.clone(), b.clone()].concat(), (9, 16), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let got = up
                .cast_concat(&[&a, &b], dtype, (9, 16), &Device::Cpu)
                .unwrap();
            assert_eq!(got.dtype(), dtype);
            let want = f32s.to_dtype(dtype).unwrap();
            assert_eq!(crate::ops::max_abs_diff(&got, &want), 0.0, "{dtype:?}");
        }
    }

    #[test]
    fn a_wrong_size_or_dtype_is_refused() {
        let a = vec![0.5f32; 10];
        let up = Uploads::new();
        let e = up
            .cast_concat(&[&a], DType::BF16, (3, 4), &Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("[3, 4] got 10 values"), "{e}");
        let e = up
            .cast_concat(&[&a], DType::U32, (2, 5), &Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("U32"), "{e}");
    }

    /// The pinned path against the host's cast, bit for bit: two uploads into one buffer
    /// queued behind a long spin of the GPU, back to back. The first must return before the
    /// spin ends (the copy is queued, not waited for), and the second must not overwrite the
    /// buffer under the first's queued copy (without the wait on `copied` the first tensor
    /// would hold the second's values). Then a larger upload, which replaces the buffer.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_pinned_upload_is_the_cast_and_waits_for_its_last_copy() {
        let Some(dev) =
            crate::ops::test_gpu("the_pinned_upload_is_the_cast_and_waits_for_its_last_copy")
        else {
            return;
        };
        let shapes = [(2048, 1536), (2048, 1536), (4096, 1536)];
        let inputs: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(k, &(rows, cols))| {
                (0..rows * cols)
                    .map(|i| ((i * 31 + k * 7919) % 1009) as f32 / 1009.0 - 0.5)
                    .collect()
            })
            .collect();
        let up = Uploads::new();
        set_pinned(Some(true));
        // Kernels and the pool warmed, the buffer made at the first shape.
        up.cast_concat(&[&inputs[0]], DType::BF16, shapes[0], &dev)
            .unwrap();
        dev.synchronize().unwrap();
        let spin_ns = 300_000_000;
        crate::ops::gpu_delay(&dev, spin_ns).unwrap();
        let t = std::time::Instant::now();
        let mut got = Vec::new();
        for (x, &shape) in inputs.iter().zip(&shapes).take(1) {
            let (a, b) = x.split_at(x.len() / 3);
            got.push(up.cast_concat(&[a, b], DType::BF16, shape, &dev).unwrap());
        }
        let queued = t.elapsed();
        for (x, &shape) in inputs.iter().zip(&shapes).skip(1) {
            got.push(up.cast_concat(&[x], DType::BF16, shape, &dev).unwrap());
        }
        set_pinned(None);
        assert!(
            queued.as_nanos() < u128::from(spin_ns) / 2,
            "the first upload took {queued:?} behind a {} ms spin: its copy was waited for",
            spin_ns / 1_000_000
        );
        for (k, (t, x)) in got.iter().zip(&inputs).enumerate() {
            let want: Vec<u16> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let have: Vec<u16> = t
                .flatten_all()
                .unwrap()
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert!(
                have == want,
                "upload {k} is not the host's cast of its values"
            );
        }
    }
}
