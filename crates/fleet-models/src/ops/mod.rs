//! Fused operations of the decoder: one kernel where candle would launch several, one file
//! per op. Each file holds the op, its CPU twin (the same arithmetic in the same order, which
//! the CPU parity tests run), its backward (candle's `bwd`), its CUDA launcher and, beside it,
//! its kernel source (`<op>.cu`, compiled to PTX by build.rs; `common.cuh` holds the
//! conversions and block reductions every kernel shares).
//!
//! - [`masked_softmax`]: causal + left-padding mask and softmax over attention scores, with
//!   f32 statistics, reading and writing the model dtype (replaces cast, mask add, softmax,
//!   cast, and the mask tensor itself).
//! - [`swiglu`]: `silu(gate) * up` on the fused gate/up projection (replaces two strided
//!   element-wise kernels).
//! - [`linear_bias_epilogue`] and [`linear_gelu_tanh`]: an inference-only linear layer's
//!   bias, and a tanh GELU, in the GEMM's cuBLASLt epilogue ([`linear_epilogue`]; replaces the
//!   bias and activation passes).
//! - [`rms_norm`] and [`add_rms_norm`]: RMSNorm with transformers' roundings, and a residual
//!   add with the RMSNorm after it in one pass; [`LayerNorm`]: the vision tower's LayerNorm,
//!   with the residual add before it folded in (inference only).
//! - [`qkv_rope`]: the fused q/k/v projection split into head-major q, k, v with RoPE applied
//!   to q and k (replaces a transpose copy, per-part copies and the RoPE kernels);
//!   [`qk_norm_rope`]: the same for Qwen3, with the per-head RMSNorm of q and k before RoPE;
//!   [`qkv_rope_paged`] and [`qk_norm_rope_paged`] write k and v into a paged cache instead;
//!   [`linear_qkv_rope_paged`] is the projection and [`qkv_rope_paged`] in one decode kernel.
//!   Both read one RoPE table layout: `[cos | sin]` per position.
//! - [`logp_entropy`] and [`logp_grad`]: the training head's log-softmax, forward and backward.
//! - [`sample_tokens`]: the next token of every row (transformers' sampling processors and
//!   the draw in one kernel) and its log-probability, on the device.
//! - [`adamw_step_`]: the optimizer's fused step; [`add_matmul_tn_`]: a weight gradient added
//!   to its sum by the GEMM itself (`beta = 1`).
//! - [`concat_rows`]: projections that read one input stacked into one weight (q/k/v,
//!   gate/up), the attention scale folded into the first (replaces a cast, an affine, a cast
//!   and one copy a part).
//! - [`transpose12`]: a rank-4 tensor's dimensions 1 and 2 swapped into a contiguous copy in
//!   16-byte vectors (the training attention's output gradient read head-major).
//! - [`linear`]: a linear layer with the bias added in place after the GEMM, and the decode
//!   step's few-row products that stream the weights once: [`gemv`] (up to 4 rows) and
//!   [`skinny_gemm`] (5 to 64, on the tensor cores).
//! - [`paged_kv_write`] and [`paged_decode_attention`]: the paged KV cache's write of new keys
//!   and values into their slots, and split-KV decode attention over a row's blocks (GQA, each
//!   KV head read once per query group); inference only, capturable in a CUDA graph.
//!
//! Every op of the decoder has a backward (candle's `bwd`), so the decoder that serves
//! inference is also the one that trains; the vision tower's (epilogues, LayerNorm) and the
//! in-place ones (the optimizer's, the gradient sums', the KV cache's) have none. A result is tracked only when an input is (a `Var` or computed from one):
//! at inference nothing is recorded and nothing is kept. The backward is computed in f32 with
//! candle tensor ops and cast to the input's dtype; it differentiates the exact math (the
//! forward's intermediate roundings to the model dtype are not differentiated, as in torch's
//! autograd of transformers, except where a rounded value is itself a factor of the gradient:
//! the normalised value in the weight gradient of an RMSNorm). tests/ops_grad.rs checks each
//! backward against finite differences and against candle's autograd of the composed math.
//!
//! Adding a fused op: a file here with the op, its twin, its backward and its launcher, and its
//! kernel beside it as `<op>.cu` (build.rs compiles every `.cu` in this directory).

use candle_core::{DType, Layout, Tensor, WithDType};
use half::{bf16, f16};

/// `t` itself when contiguous, else a contiguous copy (the kernels read rows in place).
fn contig(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.is_contiguous() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Runs a custom op's backward; when profiling, adds its synchronized time to `stage`.
fn bwd_timed<T>(
    dev: &candle_core::Device,
    stage: &'static str,
    f: impl FnOnce() -> candle_core::Result<T>,
) -> candle_core::Result<T> {
    if !crate::profile::enabled() {
        return f();
    }
    dev.synchronize()?;
    let t = std::time::Instant::now();
    let out = f()?;
    dev.synchronize()?;
    crate::profile::record(stage, t.elapsed().as_secs_f64());
    Ok(out)
}

/// Conversions between the model dtypes and f32, for the CPU kernels.
trait Float: Copy + Send + Sync + WithDType {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `x` rounded to this type and back: the value the model dtype holds.
    fn round(x: f32) -> f32 {
        Self::from_f32(x).to_f32()
    }
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

macro_rules! float_cpu {
    ($op:literal, $( ($s:expr, $l:expr) => $x:ident ),+ ; $body:expr) => {
        match ($($s,)+) {
            float_cpu!(@pat F32; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::F32($body)
            }
            float_cpu!(@pat BF16; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::BF16($body)
            }
            float_cpu!(@pat F16; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::F16($body)
            }
            _ => candle_core::bail!(concat!($op, ": inputs must share one of f32, f16, bf16")),
        }
    };
    (@pat $v:ident; $($x:ident),+) => { ($(CpuStorage::$v($x),)+) };
}

/// Sum of lane values in the order of a kernel's xor butterfly (`butterfly_sum` in
/// paged_attention.cu, the GEMV's warp sum in linear.cu):
/// at each offset `o` (half the lanes, then half that, ...), lane `l < o` adds lane `l + o`.
fn butterfly<const N: usize>(mut lanes: [f32; N]) -> f32 {
    let mut o = N / 2;
    while o > 0 {
        for l in 0..o {
            lanes[l] += lanes[l + o];
        }
        o /= 2;
    }
    lanes[0]
}

fn contiguous<'a, T>(data: &'a [T], layout: &Layout) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("fused op input must be contiguous"),
    }
}

/// A forward-only custom op that runs on CUDA alone: the CPU refuses it (the CPU keeps the
/// composed backward). `$op` names the op's `self` in the CUDA body.
macro_rules! cuda_only_op {
    (CustomOp2 for $ty:ty, $name:literal,
     |$op:ident, $s1:ident, $l1:ident, $s2:ident, $l2:ident| $body:expr) => {
        impl candle_core::CustomOp2 for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                _: &CpuStorage,
                _: &Layout,
                _: &CpuStorage,
                _: &Layout,
            ) -> candle_core::Result<(CpuStorage, Shape)> {
                candle_core::bail!(concat!($name, " runs on CUDA only"))
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $s1: &candle_core::CudaStorage,
                $l1: &Layout,
                $s2: &candle_core::CudaStorage,
                $l2: &Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
                let $op = self;
                $body
            }
        }
    };
    (CustomOp3 for $ty:ty, $name:literal,
     |$op:ident, $s1:ident, $l1:ident, $s2:ident, $l2:ident, $s3:ident, $l3:ident| $body:expr) => {
        impl candle_core::CustomOp3 for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                _: &CpuStorage,
                _: &Layout,
                _: &CpuStorage,
                _: &Layout,
                _: &CpuStorage,
                _: &Layout,
            ) -> candle_core::Result<(CpuStorage, Shape)> {
                candle_core::bail!(concat!($name, " runs on CUDA only"))
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $s1: &candle_core::CudaStorage,
                $l1: &Layout,
                $s2: &candle_core::CudaStorage,
                $l2: &Layout,
                $s3: &candle_core::CudaStorage,
                $l3: &Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
                let $op = self;
                $body
            }
        }
    };
}

/// The gradient for `arg` when it is tracked (a `Var` or computed from one); none otherwise,
/// as a constant input (a zero bias, a frozen weight) needs none.
fn wanted(
    arg: &Tensor,
    grad: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    if arg.track_op() {
        grad().map(Some)
    } else {
        Ok(None)
    }
}

/// The element type's kernel-name suffix.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => candle_core::bail!("fused ops run in f32, f16 or bf16, not {other:?}"),
    }
}

#[cfg(feature = "cuda")]
mod cuda_util {
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout};

    /// Blocks of 256 threads covering `n` elements, at most 65,535 of them: the element-wise
    /// kernels, whose grid-stride loops take what one round does not cover.
    pub(super) fn grid_stride(n: usize) -> LaunchConfig {
        let threads = 256u32;
        LaunchConfig {
            grid_dim: (
                (n as u64).div_ceil(threads as u64).clamp(1, 65_535) as u32,
                1,
                1,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Elements of `T` in one 16-byte vector: the load unit of the `_vec` kernels.
    pub(super) fn vector_len<T>() -> usize {
        16 / std::mem::size_of::<T>()
    }

    /// Whether a `_vec` kernel may take `n` elements (a row, or a whole part) read from inputs
    /// whose first elements lie at `offsets`: `n` whole vectors and every start on one (candle's
    /// buffers begin 16-byte aligned, so the offset decides).
    pub(super) fn whole_vectors<T>(n: usize, offsets: impl IntoIterator<Item = usize>) -> bool {
        let v = vector_len::<T>();
        n.is_multiple_of(v) && offsets.into_iter().all(|o| o.is_multiple_of(v))
    }

    /// One block of 1024 threads per row: the kernels that reduce over a row of logits.
    pub(super) fn row_blocks(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Whether the norms take their one-pass vector kernels where they can
    /// (`FLEET_VEC_NORM=0` keeps the first kernels, for comparison).
    pub(super) fn vec_norm_on() -> bool {
        static VEC: super::EnvSwitch = super::EnvSwitch::new("FLEET_VEC_NORM", true);
        VEC.on()
    }

    /// Threads per block of a one-pass norm kernel over rows of `vectors` 16-byte vectors, `vpt`
    /// a thread: the block's sum runs over this many threads, so a kernel that normalises a row
    /// the same way (the fused decode GEMV's prologue) launches as many to get the same bits.
    pub(super) fn vec_norm_threads(vectors: usize, vpt: usize) -> u32 {
        vectors.div_ceil(vpt).next_multiple_of(32) as u32
    }

    /// The norm kernel (`<op>` or its one-pass `<op>_vec<VPT>`) and threads per block for rows of
    /// `n` elements of `T`: the one-pass kernel when a row is whole 16-byte vectors, every
    /// input starts on one, and a block holds the row in up to `max_vpt` (1, 2 or 4) vectors a
    /// thread (`FLEET_VEC_NORM=0` keeps the first kernel, for comparison).
    pub(super) fn norm_launch_shape<T>(
        op: &str,
        n: usize,
        inputs: &[&Layout],
        max_vpt: usize,
    ) -> (String, u32) {
        let on = vec_norm_on();
        let aligned = whole_vectors::<T>(n, inputs.iter().map(|l| l.start_offset()));
        let vectors = n / vector_len::<T>();
        match [1usize, 2, 4]
            .into_iter()
            .find(|&v| v <= max_vpt && vectors <= v * 1024)
        {
            Some(vpt) if on && aligned => {
                (format!("{op}_vec{vpt}"), vec_norm_threads(vectors, vpt))
            }
            _ => (op.to_string(), 1024.min(n.next_multiple_of(32)) as u32),
        }
    }

    pub(super) fn input<'a, T: CudaDType + DeviceRepr>(
        s: &'a CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
            None => candle_core::bail!("fused op input must be contiguous"),
        }
    }

    /// Whether `dev`'s stream is recording a CUDA graph (a decode step's capture): ops that
    /// read to the host, allocate outside candle's pool (thrust) or upload host data must not
    /// run then.
    pub(crate) fn stream_capturing(dev: &candle_core::CudaDevice) -> candle_core::Result<bool> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        use candle_core::cuda_backend::WrapErr;
        Ok(dev.cuda_stream().capture_status().w()?
            != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Per-device state of a kernel family (a cuBLASLt handle), one per opened
    /// GPU or logical device in `registry`, made by `make` on first use; `None` while none
    /// exists and `dev`'s stream is capturing a graph (an allocation inside a capture would
    /// belong to the graph).
    pub(super) fn per_device<T>(
        registry: &std::sync::Mutex<Vec<(candle_core::cuda_backend::DeviceId, std::sync::Arc<T>)>>,
        dev: &candle_core::CudaDevice,
        make: impl FnOnce() -> candle_core::Result<T>,
    ) -> candle_core::Result<Option<std::sync::Arc<T>>> {
        let mut states = registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = states.iter().find(|(id, _)| *id == dev.id()) {
            return Ok(Some(s.clone()));
        }
        if stream_capturing(dev)? {
            return Ok(None);
        }
        let state = std::sync::Arc::new(make()?);
        states.push((dev.id(), state.clone()));
        Ok(Some(state))
    }

    /// The CUDA storage of a tensor an op holds beside its inputs (RoPE tables, a bias, block
    /// tables), which must be on the op's device `dev`; `op` and `what` name them in the error.
    pub(super) fn held<'a>(
        op: &str,
        what: &str,
        guard: &'a candle_core::Storage,
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<&'a CudaStorage> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        match guard {
            candle_core::Storage::Cuda(s) if s.device().same_device(dev) => Ok(s),
            _ => candle_core::bail!("{op}: {what} must be on the device of its inputs"),
        }
    }

    pub(super) fn same_shapes(
        op: &str,
        a: &Layout,
        b: &Layout,
        da: candle_core::DType,
        db: candle_core::DType,
    ) -> candle_core::Result<()> {
        if a.dims() != b.dims() || da != db {
            candle_core::bail!(
                "{op}: {:?} {da:?} and {:?} {db:?} must have the same shape and dtype",
                a.dims(),
                b.dims()
            );
        }
        Ok(())
    }
}

/// Whether `dev` is a GPU whose stream is recording a CUDA graph (`cuda_util`'s
/// `stream_capturing`); never on the CPU.
#[cfg(feature = "cuda")]
pub(crate) fn capturing(dev: &candle_core::Device) -> candle_core::Result<bool> {
    match dev {
        candle_core::Device::Cuda(cuda) => cuda_util::stream_capturing(cuda),
        _ => Ok(false),
    }
}

/// The largest `|a - b|` over all elements, in f32: the tests' comparison of a kernel with its
/// twin.
#[cfg(test)]
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let f = |t: &Tensor| t.to_dtype(DType::F32).expect("float tensor");
    let diff = (f(a) - f(b)).expect("same shapes").abs().expect("abs");
    diff.flatten_all()
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar())
        .expect("one f32")
}

/// The largest `|t|` over all elements, in f32: the scale a GPU test's tolerance is taken of.
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .and_then(|t| t.abs())
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.max(0))
        .and_then(|t| t.to_scalar())
        .expect("one f32")
}

/// A positive count read once from an environment variable (a tuning knob: a pass's tokens,
/// a grid's blocks), else its default. A value that is not a positive number is named on
/// stderr and the default kept.
pub(crate) struct EnvCount {
    var: &'static str,
    default: usize,
    value: std::sync::OnceLock<usize>,
}

impl EnvCount {
    pub(crate) const fn new(var: &'static str, default: usize) -> Self {
        EnvCount {
            var,
            default,
            value: std::sync::OnceLock::new(),
        }
    }

    /// The count (the variable is read at the first call).
    pub(crate) fn get(&self) -> usize {
        *self.value.get_or_init(|| match std::env::var(self.var) {
            Err(_) => self.default,
            Ok(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    eprintln!(
                        "{}={v:?} is not a positive number; keeping {}",
                        self.var, self.default
                    );
                    self.default
                }
            },
        })
    }
}

/// A kernel (or path) choice read once from an environment variable, which a test may force
/// either way (for comparing two paths in one process): on unless the variable is `0` when
/// `on_by_default`, else on only when it is `1`.
#[derive(Debug)]
pub struct EnvSwitch {
    var: &'static str,
    on_by_default: bool,
    from_env: std::sync::OnceLock<bool>,
    /// 0: the environment decides; 1: forced off; 2: forced on.
    forced: std::sync::atomic::AtomicU8,
}

impl EnvSwitch {
    /// The switch of variable `var`, on or off when it is unset.
    pub const fn new(var: &'static str, on_by_default: bool) -> Self {
        EnvSwitch {
            var,
            on_by_default,
            from_env: std::sync::OnceLock::new(),
            forced: std::sync::atomic::AtomicU8::new(0),
        }
    }

    /// Whether the choice is on now.
    pub fn on(&self) -> bool {
        match self.forced.load(std::sync::atomic::Ordering::Relaxed) {
            1 => false,
            2 => true,
            _ => *self.from_env.get_or_init(|| match std::env::var(self.var) {
                Ok(v) if self.on_by_default => v != "0",
                Ok(v) => v == "1",
                Err(_) => self.on_by_default,
            }),
        }
    }

    /// Forces the choice (`Some`) or hands it back to the environment (`None`).
    pub fn force(&self, on: Option<bool>) {
        let v = match on {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        };
        self.forced.store(v, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The first GPU for a kernel test, or `None` (said on stderr with the test's name) on a machine
/// without one, where the test returns without checking anything.
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn test_gpu(test: &str) -> Option<candle_core::Device> {
    match candle_core::Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("{test}: no CUDA device ({e}); not run");
            None
        }
    }
}

/// A test tensor on the CPU: uniform values in [-1, 1) from a small LCG seeded by `seed`, the
/// same every run, no RNG state shared between tests.
#[cfg(test)]
pub(crate) fn test_tensor(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let step = |s: u64| {
        s.wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
    };
    let mut s = step(seed);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = step(s);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &candle_core::Device::Cpu).expect("shape matches")
}

mod adamw;
mod concat_rows;
mod dropout;
mod embedding_grad;
mod epilogue;
mod gpu_delay;
mod grouped_gemm;
mod layer_norm;
mod linear;
mod logp;
mod masked_softmax;
mod matmul_acc;
mod moe_rows;
mod paged_attention;
mod qkv_rope;
mod reduce;
mod rms_norm;
mod sample;
mod swiglu;
mod transpose;

pub use adamw::{adamw_step_, AdamWStep};
pub use concat_rows::{concat_rows, concat_rows_reference, scaled, set_concat_rows_kernel};
pub use dropout::dropout_mask;
pub(crate) use dropout::splitmix;
pub use embedding_grad::{
    distinct_slots, embedding_grad_add_, embedding_grad_kernel, set_embedding_grad_kernel,
};
pub use epilogue::{linear_bias_epilogue, linear_epilogue, linear_gelu_tanh, Epilogue};
pub use gpu_delay::gpu_delay;
pub use grouped_gemm::grouped_linear;
pub use layer_norm::LayerNorm;
pub use linear::{
    gemv, gemv_swiglu, linear, linear_swiglu, moe_gemv, norm_linear, norm_linear_reference,
    set_skinny_gemm, skinny_gemm, GEMV_MAX_ROWS, SKINNY_MAX_ROWS,
};
pub use logp::{logp_entropy, logp_grad};
pub use masked_softmax::masked_softmax;
pub(crate) use masked_softmax::masked_softmax_backward;
pub use matmul_acc::{add_matmul_tn_, add_matmul_tn_supported};
pub use moe_rows::{
    gather_rows, gather_rows_reference, moe_combine, moe_combine_reference, moe_plan, MoePlan,
};
#[cfg(feature = "cuda")]
pub use paged_attention::set_paged_mma;
pub use paged_attention::{
    paged_decode_attention, paged_decode_attention_reference, paged_decode_supported,
    paged_kv_write, PAGED_ATTENTION_MAX_GROUP, PAGED_ATTENTION_MIN_BLOCKS,
    PAGED_ATTENTION_MIN_PARTITION, PAGED_ATTENTION_PARTITION,
};
pub use qkv_rope::{
    linear_qkv_rope_paged, qk_norm_rope, qk_norm_rope_paged, qkv_rope, qkv_rope_backward,
    qkv_rope_paged, set_qkv_rope_fused_backward, set_qkv_rope_pairs, PagedKvWrite,
};
pub use reduce::{gradient_seed, scale_in_place, sum_squares, update_rows_in_place};
pub use rms_norm::{add_rms_norm, residual_rms_norm, rms_norm, set_norm_backward_vector_kernel};
pub use sample::{sample_tokens, sample_tokens_on_device, RowSampling, SAMPLER_VERSION};
pub use swiglu::{set_swiglu_scalar_kernels, swiglu};
pub use transpose::{set_transpose12_kernel, transpose12};
