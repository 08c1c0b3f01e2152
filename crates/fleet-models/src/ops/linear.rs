//! Linear layers: `x · wᵀ + b` with the bias added in place on CUDA, and the decode steps'
//! few-row products as kernels that stream the weights once, each with its CPU twin: a GEMV
//! for up to 4 rows, a tensor-core "skinny" GEMM for 5 to 64.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::*;
use crate::error::Result;

/// Most rows of `x` that [`linear`] sends to the GEMV kernel (a decode step of up to this many
/// sequences); more go to cuBLAS.
pub const GEMV_MAX_ROWS: usize = 4;

/// Most rows of `x` that [`linear`] sends to the skinny GEMM kernel ([`skinny_gemm`]); more go
/// to cuBLAS.
pub const SKINNY_MAX_ROWS: usize = 64;

/// `x · wᵀ + b` of a linear layer ([`candle_nn::Linear`]'s result). On CUDA, when nothing is
/// tracked for a backward:
/// - up to [`GEMV_MAX_ROWS`] rows in f16 or bf16 (a decode step) take [`gemv`], which reads
///   each weight once at close to the memory bandwidth (cuBLAS reached 57–86% on a 7B decode
///   step at batch 1, measured with ncu on an H100); up to [`SKINNY_MAX_ROWS`] take
///   [`skinny_gemm`] with `FLEET_SKINNY_GEMM=1` and kernels built for sm_90 (correct; off by
///   default: on an H200 it is 1.00-1.03x cuBLAS at 5-8 rows of a 7B decode, 0.94-0.99x at
///   32, 0.89x at 64 and 0.76-0.82x on the 0.5B/1.5B rollouts — docs/benchmarks.md,
///   2026-11-29h);
///   `FLEET_DECODE_GEMV=0` turns both off;
/// - the bias is added in place by one kernel after the product: candle's broadcast add is a
///   strided kernel that took 4x the GEMM itself on the vision tower's `[65536, 4304]`
///   activations (measured on an H200).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    project(layer, x, false)
}

/// [`linear`], then with `swiglu` (`layer` the MLP's fused gate/up projection) the SwiGLU:
/// where the product takes the GEMV and no bias comes between, one kernel ([`gemv_swiglu`]).
fn project(layer: &candle_nn::Linear, x: &Tensor, swiglu: bool) -> Result<Tensor> {
    use candle_core::Module;
    let w = layer.weight();
    let bias = layer.bias();
    let act = |y: Tensor| match swiglu {
        true => super::swiglu(&y),
        false => Ok(y),
    };
    let tracked = x.track_op() || w.track_op() || bias.is_some_and(|b| b.track_op());
    if !x.device().is_cuda() || tracked {
        return act(layer.forward(x)?);
    }
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let rows = x.elem_count() / k.max(1);
    let with_width = |y: Tensor, n: usize| -> Result<Tensor> {
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("rank >= 1") = n;
        Ok(y.reshape(out_dims)?)
    };
    let y = if gemv_takes(x, w, rows) {
        let n = w.dim(0)?;
        if swiglu && bias.is_none() && GEMV_SWIGLU.on() && n.is_multiple_of(2) {
            return with_width(gemv_swiglu(&x.reshape((rows, k))?, w)?, n / 2);
        }
        gemv(&x.reshape((rows, k))?, w)?
    } else if skinny_takes(x, w, rows) {
        skinny_gemm(&x.reshape((rows, k))?, w)?
    } else if bias.is_none() {
        return act(layer.forward(x)?);
    } else {
        x.reshape((rows, k))?.matmul(&w.t()?)?
    };
    if let Some(bias) = bias {
        y.inplace_op2(&contig(bias)?, &AddBiasRows)?;
    }
    act(with_width(y, w.dim(0)?)?)
}

/// Whether the decode kernels ([`gemv`], [`skinny_gemm`]) may take this product: f16 or bf16,
/// a 2-D weight of the input's dtype, contiguous inputs whose rows start on 16 bytes, `k` a
/// multiple of `k_multiple`, and `FLEET_DECODE_GEMV` not `0`.
fn decode_kernel_takes(x: &Tensor, w: &Tensor, k_multiple: usize) -> bool {
    static ON: EnvSwitch = EnvSwitch::new("FLEET_DECODE_GEMV", true);
    let on = ON.on();
    let k = w.dims().last().copied().unwrap_or(0);
    let aligned = |t: &Tensor| {
        let (_, l) = t.storage_and_layout();
        l.is_contiguous() && l.start_offset().is_multiple_of(8)
    };
    on && matches!(x.dtype(), DType::BF16 | DType::F16)
        && x.dtype() == w.dtype()
        && w.rank() == 2
        && k.is_multiple_of(k_multiple)
        && aligned(x)
        && aligned(w)
}

/// Whether [`linear`] sends this product to [`gemv`]: at most [`GEMV_MAX_ROWS`] rows, `k` a
/// multiple of 8 ([`decode_kernel_takes`]).
pub(super) fn gemv_takes(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    (1..=GEMV_MAX_ROWS).contains(&rows) && decode_kernel_takes(x, w, GEMV_CHUNK)
}

/// Whether [`linear`] sends this product to [`skinny_gemm`]: more than [`GEMV_MAX_ROWS`] and at
/// most [`SKINNY_MAX_ROWS`] rows, `k` a multiple of 32 and `n` of 16 ([`decode_kernel_takes`]),
/// kernels built for sm_90 or later (its TMA copies), and `FLEET_SKINNY_GEMM=1` in the
/// environment: off by default, no faster than cuBLAS beyond a 1-3% margin at 5-8 rows of a 7B
/// (its GPU test passes; docs/benchmarks.md has the speeds).
fn skinny_takes(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    SKINNY_GEMM.on()
        && built_for_sm90()
        && (GEMV_MAX_ROWS + 1..=SKINNY_MAX_ROWS).contains(&rows)
        && w.dims()
            .first()
            .is_some_and(|n| n.is_multiple_of(SKINNY_N_MULTIPLE))
        && decode_kernel_takes(x, w, SKINNY_K_MULTIPLE)
}

/// `x · wᵀ` for `x` `[m, k]` with few rows and `w` `[n, k]` (f32, f16 or bf16, contiguous;
/// on CUDA f16 or bf16, `m` at most [`GEMV_MAX_ROWS`], `k` a multiple of 8, rows starting on
/// 16 bytes): `[m, n]` in the inputs' dtype. One warp per output column: lane `l` sums the
/// 8-element chunks `l, l + 32, ...` of the row in order (f32 fused multiply-adds), the 32
/// lanes are summed by the xor butterfly, and the result is rounded once to the dtype, as the
/// GEMM rounds it. On the CPU it is the kernel's twin (the same sums in the same order), for
/// testing; [`linear`] uses it on CUDA only.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.apply_op2_no_bwd(w, &FewRows::Gemv)?)
}

/// [`swiglu`](super::swiglu) of [`gemv`] for the MLP's fused gate/up weight `w` (`[2n, k]`,
/// gate rows then up rows): `[m, n]`, one kernel on CUDA whose warp for column `j` sums rows
/// `j` and `n + j` as [`gemv`] does and ends in the SwiGLU kernel's arithmetic, so the result
/// is the two ops' bits (its GPU test checks it) with one launch and one `[m, 2n]` round trip
/// fewer. On the CPU the twin is the two twins in turn.
pub fn gemv_swiglu(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.apply_op2_no_bwd(w, &FewRows::GemvSwiglu)?)
}

/// `swiglu(linear(layer, x))` for the MLP's fused gate/up projection: [`gemv_swiglu`] where
/// [`linear`] would take the GEMV (a decode step of up to [`GEMV_MAX_ROWS`] rows on CUDA, no
/// bias, nothing tracked) and `FLEET_GEMV_SWIGLU` is not `0`, else the two ops.
pub fn linear_swiglu(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    project(layer, x, true)
}

/// Switch of [`linear_swiglu`]'s one kernel (`FLEET_GEMV_SWIGLU=0`: the GEMV and the SwiGLU
/// kernel; the same bits either way).
static GEMV_SWIGLU: EnvSwitch = EnvSwitch::new("FLEET_GEMV_SWIGLU", true);

/// A bias-free linear layer `proj` on the RMSNorm of the residual stream, as a decoder layer
/// opens its attention and its MLP: `(s, y)` with `s = x + pending` (`x` itself when nothing
/// is pending), `h = rms_norm(s) * norm_w` ([`add_rms_norm`]'s arithmetic) and
/// `y = linear(proj, h)`, or with `swiglu` (`proj` the fused gate/up projection)
/// `y = swiglu(linear(proj, h))`. With `FLEET_NORM_GEMV=1`, on a decode step on CUDA
/// (a product [`gemv`] takes, its normalised rows fitting in shared memory), this is one
/// kernel instead of two or three, whose outputs are the
/// unfused ops' bits (its GPU test passes on an H200); otherwise, and by default, it is those
/// ops, [`norm_linear_reference`]. Off by default because it is slower: the 7B's decode at
/// batch 1 ran 219.5 tok/s fused against 233.5 unfused (H200, 2026-11-29d). By ncu the fused
/// gate/up streamed at 3.56 TB/s against the GEMV's 4.20, and q/k/v at 2.12 against 2.88:
/// its blocks have the norm's thread count (14 warps at the 7B's 3,584, 330 blocks for
/// q/k/v, 2.5 an SM) where the GEMV's have 4, and each warp streamed the gate and then the up row
/// (their loads go out together since 2026-11-29e, not measured here since). A paged decode
/// step of Qwen2's attention opens with the norm alone and [`linear_qkv_rope_paged`] instead
/// (the decoder layer's choice), so there only the MLP's projection takes this kernel.
///
/// [`linear_qkv_rope_paged`]: super::linear_qkv_rope_paged
pub fn norm_linear(
    x: &Tensor,
    pending: Option<&Tensor>,
    (norm_w, eps): (&Tensor, f32),
    proj: &candle_nn::Linear,
    swiglu: bool,
) -> Result<(Tensor, Tensor)> {
    let w = proj.weight();
    if proj.bias().is_some() || !norm_gemv_takes(x, pending, norm_w, w, swiglu) {
        return norm_linear_reference(x, pending, (norm_w, eps), proj, swiglu);
    }
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let rows = x.elem_count() / k;
    let n = if swiglu { w.dim(0)? / 2 } else { w.dim(0)? };
    let op = NormGemv {
        pending: pending.map(contig).transpose()?,
        norm_w: contig(norm_w)?,
        eps,
        swiglu,
    };
    let flat = contig(x)?.apply_op2_no_bwd(&contig(w)?, &op)?;
    // The kernel's one buffer: s (when something was pending), then y.
    let s_len = if pending.is_some() { rows * k } else { 0 };
    let s = match pending {
        Some(_) => flat.narrow(0, 0, s_len)?.reshape(dims)?,
        None => x.clone(),
    };
    let mut y_dims = dims.to_vec();
    *y_dims.last_mut().expect("rank >= 1") = n;
    let y = flat.narrow(0, s_len, rows * n)?.reshape(y_dims)?;
    Ok((s, y))
}

/// [`norm_linear`] op by op: [`residual_rms_norm`], [`linear`] (and [`swiglu`]: together
/// [`linear_swiglu`]). The fused kernel's twin, and its path wherever the kernel does not run.
pub fn norm_linear_reference(
    x: &Tensor,
    pending: Option<&Tensor>,
    (norm_w, eps): (&Tensor, f32),
    proj: &candle_nn::Linear,
    swiglu: bool,
) -> Result<(Tensor, Tensor)> {
    let (s, h) = residual_rms_norm(x, pending, norm_w, eps)?;
    let y = match swiglu {
        true => linear_swiglu(proj, &h)?,
        false => linear(proj, &h)?,
    };
    Ok((s, y))
}

/// Switch of the fused decode projection ([`norm_linear`]): `FLEET_NORM_GEMV=1` runs the norm,
/// the GEMV and the SwiGLU as one kernel (the same bits); off by default (slower, see
/// [`norm_linear`]).
static NORM_GEMV: EnvSwitch = EnvSwitch::new("FLEET_NORM_GEMV", false);

/// Switch of the GEMV's pipelined kernel for grids of less than a wave (`FLEET_GEMV_PIPE=0`:
/// the four-loads kernel for every product; the same bits either way).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static GEMV_PIPE: EnvSwitch = EnvSwitch::new("FLEET_GEMV_PIPE", true);

/// Largest shared memory the fused decode projection asks for: its rows of `h` (the default
/// a block may use without opting in).
const NORM_GEMV_SMEM: usize = 48 * 1024;

/// Whether [`norm_linear`] runs as one kernel: a product [`gemv`] takes (up to
/// [`GEMV_MAX_ROWS`] rows, f16 or bf16 on CUDA, nothing tracked), whose normalised rows fit in
/// [`NORM_GEMV_SMEM`] and whose norm the one-pass kernel computes in one vector a thread (rows
/// of up to 8,192 elements: the kernel's prologue is that norm's arithmetic), `pending` and
/// `norm_w` contiguous, of `x`'s dtype and shape (`norm_w` its last dimension), and
/// `FLEET_NORM_GEMV=1`.
fn norm_gemv_takes(
    x: &Tensor,
    pending: Option<&Tensor>,
    norm_w: &Tensor,
    w: &Tensor,
    swiglu: bool,
) -> bool {
    let k = w.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count() / k.max(1);
    let tracked = [Some(x), pending, Some(norm_w), Some(w)]
        .into_iter()
        .flatten()
        .any(|t| t.track_op());
    let like_x = |t: &Tensor, dims: &[usize]| {
        let (_, l) = t.storage_and_layout();
        t.dtype() == x.dtype()
            && t.dims() == dims
            && l.is_contiguous()
            && l.start_offset().is_multiple_of(GEMV_CHUNK)
    };
    NORM_GEMV.on()
        && x.device().is_cuda()
        && !tracked
        && vec_norm_on()
        && x.dims().last() == Some(&k)
        && k / GEMV_CHUNK <= 1024
        && rows * k * x.dtype().size_in_bytes() <= NORM_GEMV_SMEM
        && (!swiglu || w.dim(0).is_ok_and(|n| n % 2 == 0))
        && gemv_takes(x, w, rows)
        && pending.is_none_or(|p| like_x(p, x.dims()))
        && like_x(norm_w, &[k])
}

/// Whether the norms run their one-pass kernels (the fused projection's prologue is theirs).
fn vec_norm_on() -> bool {
    #[cfg(feature = "cuda")]
    return super::cuda_util::vec_norm_on();
    #[cfg(not(feature = "cuda"))]
    false
}

/// [`norm_linear`]'s kernel as a custom op on `(x, w)`: one flat output, `s` (when `pending`)
/// then `y`. CUDA only: elsewhere [`norm_linear`] runs [`norm_linear_reference`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct NormGemv {
    pending: Option<Tensor>,
    norm_w: Tensor,
    eps: f32,
    swiglu: bool,
}

impl candle_core::CustomOp2 for NormGemv {
    fn name(&self) -> &'static str {
        "fleet-norm-gemv"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("fleet-norm-gemv runs on CUDA only (norm_linear_reference elsewhere)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let k = l1.dims()[l1.dims().len() - 1];
        let (m, (n2, k2)) = (l1.shape().elem_count() / k, l2.shape().dims2()?);
        if k != k2 || !(1..=GEMV_MAX_ROWS).contains(&m) || !k.is_multiple_of(GEMV_CHUNK) {
            candle_core::bail!("norm_gemv: x [{m}, {k}] and w [{n2}, {k2}]");
        }
        let n = if self.swiglu { n2 / 2 } else { n2 };
        let out = cuda::norm_gemv(self, (s1, l1), (s2, l2), (m, n, k))?;
        let len = if self.pending.is_some() { m * k } else { 0 } + m * n;
        Ok((out, Shape::from(len)))
    }
}

/// Which few-row product ([`gemv`] or [`skinny_gemm`]).
#[derive(Debug, Clone, Copy)]
enum FewRows {
    Gemv,
    /// [`gemv`] ending in the SwiGLU ([`gemv_swiglu`]).
    GemvSwiglu,
    Skinny,
}

/// Lanes of a warp, each summing its chunks of a row.
const GEMV_LANES: usize = 32;
/// Elements per 16-byte load of f16 or bf16.
const GEMV_CHUNK: usize = 8;

fn gemv_cpu<T: Float>(x: &[T], w: &[T], k: usize) -> Vec<T> {
    let (m, n) = (x.len() / k, w.len() / k);
    let mut y = Vec::with_capacity(m * n);
    for xr in x.chunks(k) {
        for wr in w.chunks(k) {
            let mut lanes = [0f32; GEMV_LANES];
            for (lane, acc) in lanes.iter_mut().enumerate() {
                for c in (lane..k / GEMV_CHUNK).step_by(GEMV_LANES) {
                    for i in c * GEMV_CHUNK..(c + 1) * GEMV_CHUNK {
                        *acc = xr[i].to_f32().mul_add(wr[i].to_f32(), *acc);
                    }
                }
            }
            y.push(T::from_f32(butterfly(lanes)));
        }
    }
    debug_assert_eq!(y.len(), m * n);
    y
}

fn gemv_dims(l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
    if k != k2 || !k.is_multiple_of(GEMV_CHUNK) {
        candle_core::bail!("gemv: x [{m}, {k}] and w [{n}, {k2}] (k a multiple of 8)");
    }
    Ok((m, n, k))
}

/// A MoE decode step's routed products, one launch per projection: for each routed slot `s`
/// (token `s / top_k`'s expert `e`), `y[s] = x[s / in_div] · w[e]ᵀ`, with `x` `[rows, k]`, `w`
/// `[experts, n, k]` and `sorted` u32 `[2, slots]` — the slots' experts in ascending order, then
/// each one's slot (as `sort_last_dim` gives them) — giving `[slots, n]`. `in_div`: `top_k`
/// when `x` holds the tokens (the gate/up projection), 1 when it holds the slots' own rows
/// (down). On CUDA (f16, bf16; `k` a multiple of 8, rows starting on 16 bytes) each touched
/// expert's weights are read once for up to four of its slots at a time, an untouched one's
/// not at all: the step is bound by the touched experts' bytes. Every output is [`gemv`]'s sum
/// in [`gemv`]'s order, so the CPU twin is [`gemv`]'s row by row and the two agree bit for bit
/// (on the tensor cores, the default for `k` a multiple of 32 and `n` of 16: to a unit in the
/// last place).
pub fn moe_gemv(x: &Tensor, w: &Tensor, sorted: &Tensor, in_div: usize) -> Result<Tensor> {
    Ok(x.apply_op3_no_bwd(w, sorted, &MoeGemv { in_div })?)
}

/// Whether [`moe_gemv`] runs on the tensor cores on CUDA (warps of 16 columns over each
/// expert's slots, 8 (or 16: [`MOE_MMA16`]) at a time; sums in their order, within a unit in
/// the last place of the twin's), for `k` a multiple of 32 and `n` of 16: on by default,
/// `FLEET_MOE_MMA=0` for the GEMV kernel (whose outputs are the twin's bit for bit). On an
/// H200 (2026-11-28f) the 30B-A3B judge's decode took 2.04 / 2.02 s a batch of 32 against the
/// GEMV's 3.46 / 3.58, the kernel at 2.5 TB/s against the GEMV's 0.7–0.9.
#[cfg(feature = "cuda")]
static MOE_MMA: EnvSwitch = EnvSwitch::new("FLEET_MOE_MMA", true);

/// Whether the tensor-core kernel of [`moe_gemv`] takes an expert's slots 16 at a time
/// against each load of its weights instead of 8 (`FLEET_MOE_MMA16=0` for 8): an expert with 9
/// to 16 slots has its weights read once, not twice. The same bits either way (each slot's
/// sums are its own mma column). On an H200 (2026-11-29) the 30B-A3B judge's decode at 96 took
/// 3.87 s a batch against 4.92 with groups of 8.
#[cfg(feature = "cuda")]
static MOE_MMA16: EnvSwitch = EnvSwitch::new("FLEET_MOE_MMA16", true);

/// Slots a group of the tensor-core kernel of [`moe_gemv`] ([`MOE_MMA16`]).
#[cfg(feature = "cuda")]
fn moe_mma_group() -> usize {
    if MOE_MMA16.on() {
        16
    } else {
        8
    }
}

/// Whether [`moe_gemv`] takes the tensor-core kernel for `[n, k]` experts (see [`MOE_MMA`]).
#[cfg(feature = "cuda")]
fn moe_mma_takes(n: usize, k: usize) -> bool {
    MOE_MMA.on() && k.is_multiple_of(SKINNY_K_MULTIPLE) && n.is_multiple_of(SKINNY_N_MULTIPLE)
}

/// [`moe_gemv`] as a custom op.
#[derive(Debug, Clone, Copy)]
struct MoeGemv {
    in_div: usize,
}

impl MoeGemv {
    /// `(rows, experts, n, k, slots)`, checked.
    fn dims(
        &self,
        l1: &Layout,
        l2: &Layout,
        l3: &Layout,
    ) -> candle_core::Result<(usize, usize, usize, usize, usize)> {
        let (rows, k) = l1.shape().dims2()?;
        let (experts, n, k2) = l2.shape().dims3()?;
        let (two, slots) = l3.shape().dims2()?;
        if k != k2 || !k.is_multiple_of(GEMV_CHUNK) || two != 2 || self.in_div == 0 {
            candle_core::bail!(
                "moe_gemv: x [{rows}, {k}], w [{experts}, {n}, {k2}], sorted [{two}, {slots}], \
                 in_div {} (k a multiple of 8, sorted [2, slots], in_div at least 1)",
                self.in_div
            );
        }
        if slots.div_ceil(self.in_div) > rows {
            candle_core::bail!(
                "moe_gemv: {slots} slots read rows up to {} of x, which has {rows}",
                slots.div_ceil(self.in_div)
            );
        }
        Ok((rows, experts, n, k, slots))
    }
}

/// The twin: [`gemv_cpu`] for each slot's row against its expert's weights. `sorted` must be
/// the slots' experts in ascending order and a permutation of the slots (what the kernel
/// assumes; checked here).
fn moe_gemv_cpu<T: Float>(
    x: &[T],
    w: &[T],
    sorted: &[u32],
    (n, k, in_div, experts): (usize, usize, usize, usize),
) -> candle_core::Result<Vec<T>> {
    let slots = sorted.len() / 2;
    let (ids, slot_of) = sorted.split_at(slots);
    if ids.windows(2).any(|p| p[0] > p[1]) || ids.iter().any(|&e| e as usize >= experts) {
        candle_core::bail!("moe_gemv: the experts must be ascending and below {experts}");
    }
    let mut y = vec![T::from_f32(0.0); slots * n];
    let mut seen = vec![false; slots];
    for (&e, &s) in ids.iter().zip(slot_of) {
        let s = s as usize;
        if s >= slots || std::mem::replace(&mut seen[s], true) {
            candle_core::bail!("moe_gemv: the slots must be a permutation of 0..{slots}");
        }
        let xr = &x[s / in_div * k..(s / in_div + 1) * k];
        let we = &w[e as usize * n * k..(e as usize + 1) * n * k];
        y[s * n..(s + 1) * n].copy_from_slice(&gemv_cpu(xr, we, k));
    }
    Ok(y)
}

impl candle_core::CustomOp3 for MoeGemv {
    fn name(&self) -> &'static str {
        "fleet-moe-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, experts, n, k, slots) = self.dims(l1, l2, l3)?;
        let CpuStorage::U32(sorted) = s3 else {
            candle_core::bail!("moe_gemv: sorted must be u32");
        };
        let sorted = contiguous(sorted, l3)?;
        let dims = (n, k, self.in_div, experts);
        let out = float_cpu!("moe_gemv", (s1, l1) => x, (s2, l2) => w;
            moe_gemv_cpu(x, w, sorted, dims)?);
        Ok((out, Shape::from((slots, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (_, experts, n, k, slots) = self.dims(l1, l2, l3)?;
        if !(l1.start_offset().is_multiple_of(8) && l2.start_offset().is_multiple_of(8)) {
            candle_core::bail!("moe_gemv: the inputs' rows must start on 16 bytes");
        }
        let y = cuda::moe_gemv(
            (s1, l1),
            (s2, l2),
            (s3, l3),
            (experts, n, k, slots, self.in_div),
        )?;
        Ok((y, Shape::from((slots, n))))
    }
}

/// `x · wᵀ` for `x` `[m, k]` with 1 to [`SKINNY_MAX_ROWS`] rows and `w` `[n, k]` (f32, f16 or
/// bf16, contiguous; on CUDA f16 or bf16, `k` a multiple of 32, `n` of 16, rows starting on 16
/// bytes): `[m, n]` in the inputs' dtype. On CUDA (kernels built for sm_90 or later) a
/// tensor-core kernel that streams `w` once through a ring of shared-memory stages filled by
/// the TMA (`mma.sync`, f32 accumulators, long `k` split over blocks and the splits summed in
/// order: deterministic), rounded once to the dtype. Its CPU twin is the product summed in f32
/// in `k` order and rounded once: the kernel's sums run in another order (the tensor cores'
/// own), so the two agree to a unit in the last place of the dtype, not bit for bit.
/// [`linear`] uses it on CUDA only.
pub fn skinny_gemm(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.apply_op2_no_bwd(w, &FewRows::Skinny)?)
}

/// Whether the CUDA kernels were built for compute capability 9.0 or later (the skinny GEMM's
/// TMA copies).
fn built_for_sm90() -> bool {
    option_env!("FLEET_CUDA_COMPUTE_CAP")
        .and_then(|c| c.parse::<u32>().ok())
        .is_some_and(|c| c >= 90)
}

/// `k` is walked in blocks of 32 (two mma k-steps of 16).
const SKINNY_K_MULTIPLE: usize = 32;
/// Each warp computes 16 output columns.
const SKINNY_N_MULTIPLE: usize = 16;

/// `x · wᵀ` for row-major `x` `[m, k]` and `w` `[n, k]`, each product summed in f32 in `k`
/// order and rounded once: the skinny GEMM's twin, and the grouped GEMM's per expert.
pub(super) fn skinny_cpu<T: Float>(x: &[T], w: &[T], k: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len() / k * (w.len() / k));
    for xr in x.chunks(k) {
        for wr in w.chunks(k) {
            let acc = xr
                .iter()
                .zip(wr)
                .fold(0f32, |acc, (a, b)| a.to_f32().mul_add(b.to_f32(), acc));
            y.push(T::from_f32(acc));
        }
    }
    y
}

fn skinny_dims(l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
    if k != k2
        || !k.is_multiple_of(SKINNY_K_MULTIPLE)
        || !n.is_multiple_of(SKINNY_N_MULTIPLE)
        || !(1..=SKINNY_MAX_ROWS).contains(&m)
    {
        candle_core::bail!(
            "skinny_gemm: x [{m}, {k}] and w [{n}, {k2}] (1 to {SKINNY_MAX_ROWS} rows, k a \
             multiple of {SKINNY_K_MULTIPLE}, n of {SKINNY_N_MULTIPLE})"
        );
    }
    Ok((m, n, k))
}

/// Whether the MoE decode's tensor-core kernel ([`moe_gemv`]) loads the next chunk's x rows
/// while it multiplies this one's, as it already does its weights, instead of just before
/// staging it (`FLEET_SKINNY_PREFETCH_X=0` for the latter). The same sums either way. On an
/// H200 (2026-11-29) the 30B-A3B judge's decode at 96 took 4.54 s a batch against 4.92 without
/// it.
#[cfg(feature = "cuda")]
static SKINNY_PREFETCH_X: EnvSwitch = EnvSwitch::new("FLEET_SKINNY_PREFETCH_X", true);

/// Whether [`linear`] may take [`skinny_gemm`]: `FLEET_SKINNY_GEMM=1`, read once (or as
/// [`set_skinny_gemm`] set it).
static SKINNY_GEMM: EnvSwitch = EnvSwitch::new("FLEET_SKINNY_GEMM", false);

/// Test switch: whether [`linear`] takes [`skinny_gemm`] in this process, whatever
/// `FLEET_SKINNY_GEMM` says.
#[doc(hidden)]
pub fn set_skinny_gemm(enabled: bool) {
    SKINNY_GEMM.force(Some(enabled));
}

/// The two few-row products ([`gemv`], [`skinny_gemm`]) as one custom op: their checks,
/// twins and launchers by kind.
impl candle_core::CustomOp2 for FewRows {
    fn name(&self) -> &'static str {
        match self {
            FewRows::Gemv => "fleet-gemv",
            FewRows::GemvSwiglu => "fleet-gemv-swiglu",
            FewRows::Skinny => "fleet-skinny-gemm",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n, k) = self.dims(l1, l2)?;
        let out = float_cpu!("few-row product", (s1, l1) => x, (s2, l2) => w; match self {
            FewRows::Gemv => gemv_cpu(x, w, k),
            FewRows::GemvSwiglu => super::swiglu::swiglu_cpu(&gemv_cpu(x, w, k), n),
            FewRows::Skinny => skinny_cpu(x, w, k),
        });
        Ok((out, Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(l1, l2)?;
        // Both kernels read rows 16 bytes at a time (8 half-precision values).
        if !(l1.start_offset().is_multiple_of(8) && l2.start_offset().is_multiple_of(8)) {
            candle_core::bail!("{}: the inputs' rows must start on 16 bytes", self.name());
        }
        let y = match self {
            FewRows::Gemv => cuda::gemv(s1, l1, s2, l2, dims, false)?,
            FewRows::GemvSwiglu => cuda::gemv(s1, l1, s2, l2, dims, true)?,
            FewRows::Skinny => cuda::skinny_gemm(s1, l1, s2, l2, dims)?,
        };
        Ok((y, Shape::from((dims.0, dims.1))))
    }
}

impl FewRows {
    fn dims(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        match self {
            FewRows::Gemv => gemv_dims(l1, l2),
            FewRows::GemvSwiglu => match gemv_dims(l1, l2)? {
                (m, n, k) if n.is_multiple_of(2) => Ok((m, n / 2, k)),
                (_, n, _) => candle_core::bail!("gemv_swiglu: w has {n} rows (gate and up: even)"),
            },
            FewRows::Skinny => skinny_dims(l1, l2),
        }
    }
}

/// Output columns per block of the MoE decode's tensor-core kernel (`SK_COLS`: 4 warps of 16).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MOE_MMA_COLS: usize = 64;
/// Threads per block of the MoE decode's tensor-core kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MOE_MMA_THREADS: u32 = 128;

/// Output columns per block of the skinny GEMM (`SKT_COLS`: 8 consumer warps of two 16-column
/// tiles), the rows of w's TMA box.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_COLS: usize = 256;
/// Threads per block of the skinny GEMM: the 8 consumer warps and the producer's.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_THREADS: u32 = 288;
/// `k` of one pipeline stage (`SKT_KCHUNK`: 128 bytes a row, the span of the 128-byte
/// swizzle): the units of work are (column tile, chunk of k).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_KCHUNK: usize = 64;
/// Blocks an SM holds at once (the stages take up to 217 KiB of shared memory: one); the grid
/// is sized to the SMs times this.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_BLOCKS_PER_SM: usize = 1;

/// Stages of the skinny GEMM's TMA ring for `x_tiles` tiles of 8 x rows (`SkStages` in
/// linear.cu): units in flight plus the one being multiplied.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn skinny_stages(x_tiles: usize) -> usize {
    if x_tiles >= 8 {
        5
    } else {
        6
    }
}

/// Dynamic shared memory of one skinny GEMM block: each stage holds a [`SKINNY_COLS`] x
/// [`SKINNY_KCHUNK`] tile of w and `8 x_tiles` x rows of the chunk (2 bytes an element),
/// plus 1024 bytes to start the stages on the swizzle's 1024-byte period.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn skinny_smem_bytes(x_tiles: usize) -> usize {
    skinny_stages(x_tiles) * (SKINNY_COLS + 8 * x_tiles) * SKINNY_KCHUNK * 2 + 1024
}

/// Most blocks one tile's units may spread over: the partials' slots per tile (each a
/// `[rows, SKINNY_COLS]` f32 that `skinny_reduce` reads back).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_MAX_SLOTS: usize = 16;

/// How the skinny GEMM spreads its work: the `(column tile, chunk of k)` units, tile-major,
/// cut into equal contiguous ranges, one per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct SkinnyPlan {
    /// Blocks of the grid.
    blocks: usize,
    /// Chunks of [`SKINNY_KCHUNK`] in one tile's `k`.
    chunks_per_tile: usize,
    /// Units each block takes (the last block may take fewer).
    units_per_block: usize,
    /// Most blocks any tile's units are spread over: the partials' slots per tile (1: no tile
    /// is cut, no partials).
    max_slots: usize,
}

/// The plan for `n` columns and `k`: as many blocks as the GPU holds at once (`sms` x
/// [`SKINNY_BLOCKS_PER_SM`]) with equal ranges, so that no partial wave leaves most SMs idle,
/// unless a tile would spread over more than [`SKINNY_MAX_SLOTS`] blocks.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn skinny_plan(n: usize, k: usize, sms: usize) -> SkinnyPlan {
    let tiles = n.div_ceil(SKINNY_COLS);
    let chunks_per_tile = k.div_ceil(SKINNY_KCHUNK);
    let total = tiles * chunks_per_tile;
    // Enough units a block that a tile spreads over at most SKINNY_MAX_SLOTS blocks.
    let per = total
        .div_ceil((SKINNY_BLOCKS_PER_SM * sms).max(1))
        .max(chunks_per_tile.div_ceil(SKINNY_MAX_SLOTS - 1));
    let max_slots = if per.is_multiple_of(chunks_per_tile) {
        1
    } else {
        chunks_per_tile.div_ceil(per) + 1
    };
    SkinnyPlan {
        blocks: total.div_ceil(per),
        chunks_per_tile,
        units_per_block: per,
        max_slots,
    }
}

/// In place `y[r, :] += bias` (CUDA only; [`linear`] takes candle's path elsewhere).
struct AddBiasRows;

impl candle_core::InplaceOp2 for AddBiasRows {
    fn name(&self) -> &'static str {
        "fleet-add-bias-rows"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("add_bias_rows runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        cuda::add_bias_rows(s1, l1, s2, l2)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear.ptx"));
    const MODULE: &str = "fleet_linear";

    /// A TMA descriptor (`CUtensorMap`) that a kernel takes by value (`__grid_constant__`).
    #[repr(transparent)]
    struct TensorMap(candle_core::cuda_backend::cudarc::driver::sys::CUtensorMap);

    // SAFETY: a plain 128-byte value, copied into the kernel's parameters as it is.
    unsafe impl DeviceRepr for TensorMap {}

    impl TensorMap {
        /// The row-major `[rows, k]` matrix of 16-bit elements at `ptr`, read in boxes of
        /// `box_rows` rows by 64 elements (128 bytes, stored with the 128-byte swizzle); what
        /// a box covers past the rows or past `k` reads as zeros.
        fn rows<T: candle_core::WithDType>(
            ptr: u64,
            rows: usize,
            k: usize,
            box_rows: u32,
        ) -> candle_core::Result<Self> {
            use candle_core::cuda_backend::cudarc::driver::sys;
            let dtype = match T::DTYPE {
                candle_core::DType::BF16 => {
                    sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                }
                candle_core::DType::F16 => {
                    sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                }
                other => candle_core::bail!("TensorMap::rows: {other:?} (f16 or bf16)"),
            };
            let dims = [k as u64, rows as u64];
            let strides = [(k * 2) as u64];
            let boxes = [super::SKINNY_KCHUNK as u32, box_rows];
            let steps = [1u32, 1];
            let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
            // SAFETY: the arrays hold the rank (2) of dims and boxes and rank - 1 strides; the
            // driver checks the address (16-byte aligned), strides and box sizes.
            unsafe {
                sys::cuTensorMapEncodeTiled(
                    map.as_mut_ptr(),
                    dtype,
                    2,
                    ptr as *mut std::ffi::c_void,
                    dims.as_ptr(),
                    strides.as_ptr(),
                    boxes.as_ptr(),
                    steps.as_ptr(),
                    sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                    sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                    sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                )
                .result()
                .w()?;
                Ok(Self(map.assume_init()))
            }
        }
    }

    /// Warps (output columns) per block of the GEMV kernel. Four, not eight: the 7B's o and
    /// down projections (3,584 columns) gave 448 blocks of eight, 3.4 per SM of an H100's 132,
    /// so the SMs holding four set the time (2.45 TB/s in ncu against 2.97 for the gate/up
    /// projection's 4,736 blocks); 896 blocks of four come to 6.8 per SM.
    const GEMV_WARPS: usize = 4;

    /// Output columns (warps) per SM up to which the GEMV takes its pipelined kernel
    /// (`gemv_pipe`, eight loads in flight a lane instead of four): a grid of at most this
    /// many warps an SM runs in one wave, so its bandwidth is what each warp keeps in flight.
    /// The 7B's o and down projections (27 warps an SM of an H200) streamed at 70% of the
    /// bandwidth where the gate/up projection's many waves reached 87%, and at 74% with eight
    /// loads in flight: 244.0 tok/s at batch 1 against 238.4 (ncu and the bench, 2026-11-29d);
    /// its q/k/v projection (35 an SM) was no faster, so it stays below. Twelve loads in flight
    /// (bounded to fit seven blocks an SM) were slower: 219.5 against 240.2.
    const GEMV_PIPE_WARPS_PER_SM: usize = 28;

    /// The device's SMs.
    fn sms(dev: &candle_core::CudaDevice) -> candle_core::Result<usize> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let n = dev
            .cuda_stream()
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()?;
        Ok(n as usize)
    }

    /// [`super::gemv`], or with `swiglu` [`super::gemv_swiglu`] (`n` the output columns, half
    /// of w's rows).
    pub(super) fn gemv(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        (m, n, k): (usize, usize, usize),
        swiglu: bool,
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            (m, n, k): (usize, usize, usize),
            swiglu: bool,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            if !(1..=super::GEMV_MAX_ROWS).contains(&m) {
                candle_core::bail!("gemv: {m} rows (1 to {})", super::GEMV_MAX_ROWS);
            }
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            let kind = if super::GEMV_PIPE.on() && n <= GEMV_PIPE_WARPS_PER_SM * sms(&dev)? {
                "gemv_pipe"
            } else {
                "gemv"
            };
            let tail = if swiglu { "_swiglu" } else { "" };
            let func = dev.get_or_load_custom_func(
                &format!("{kind}{tail}_{}_m{m}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes every one of the m x n outputs.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(GEMV_WARPS) as u32, 1, 1),
                block_dim: ((32 * GEMV_WARPS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&x);
            builder.arg(&w);
            builder.arg(&y);
            let (n, k) = (n as i32, k as i32);
            builder.arg(&n);
            builder.arg(&k);
            // SAFETY: warp j of block b reads row c = b * GEMV_WARPS + j of w (if below n;
            // with swiglu also row n + c, w having 2 n rows: checked by the op's dims) and
            // the m rows of x, 16 bytes at a time (k a multiple of 8, rows aligned: checked),
            // and writes column c of y.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2, (m, n, k), swiglu),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2, (m, n, k), swiglu),
            other => candle_core::bail!("gemv: {other:?} on CUDA (f16 or bf16)"),
        }
    }

    /// [`super::norm_linear`]'s kernel: one warp per output column as [`gemv`], blocks of as
    /// many threads as the one-pass norm kernel takes for a row of `k` (so the prologue's sums
    /// are that kernel's), `m * k` elements of shared memory for the normalised rows.
    pub(super) fn norm_gemv(
        op: &super::NormGemv,
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (m, n, k): (usize, usize, usize),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &super::NormGemv,
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (m, n, k): (usize, usize, usize),
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            let (nw_guard, nw_l) = op.norm_w.storage_and_layout();
            let nw = input::<T>(
                held("norm_gemv", "the norm's weight", &nw_guard, &dev)?,
                nw_l,
            )?;
            let pending = op.pending.as_ref().map(|p| p.storage_and_layout());
            let name = if op.swiglu {
                "norm_gemv_swiglu"
            } else {
                "norm_gemv"
            };
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{}_m{m}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let s_len = if pending.is_some() { m * k } else { 0 };
            // SAFETY: block 0 writes all m x k sums when something is pending, and the warps
            // write every one of the m x n outputs.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(s_len + m * n)? };
            let threads = vec_norm_threads(k / 8, 1);
            let warps = threads as usize / 32;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(warps) as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: (m * k * std::mem::size_of::<T>()) as u32,
            };
            let mut builder = func.builder();
            builder.arg(&x);
            // No pending rows: a null pointer (the kernel then normalises x itself).
            let null: u64 = 0;
            let p_view = match &pending {
                Some((guard, pl)) => Some(input::<T>(
                    held("norm_gemv", "the pending rows", guard, &dev)?,
                    pl,
                )?),
                None => None,
            };
            match &p_view {
                Some(p) => builder.arg(p),
                None => builder.arg(&null),
            };
            builder.arg(&nw);
            builder.arg(&op.eps);
            builder.arg(&out);
            builder.arg(&w);
            let y = out.slice(s_len..);
            builder.arg(&y);
            let (n_arg, k_arg) = (n as i32, k as i32);
            builder.arg(&n_arg);
            builder.arg(&k_arg);
            // SAFETY: as `gemv` (warp j of block b reads row b * warps + j of w, and with
            // swiglu row n + that one, all k of it, 16 bytes at a time, k a multiple of 8 and
            // rows aligned: checked by `norm_gemv_takes`), plus the m rows of x, pending and
            // the norm's k weights, read 16 bytes at a time by one thread per vector; s and y
            // are the two disjoint parts of `out`.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(op, (s1, l1), (s2, l2), (m, n, k)),
            candle_core::DType::BF16 => run::<bf16>(op, (s1, l1), (s2, l2), (m, n, k)),
            other => candle_core::bail!("norm_gemv: {other:?} on CUDA (f16 or bf16)"),
        }
    }

    /// Columns each warp of the MoE GEMV takes in turn (the kernel's `cols`).
    const MOE_COLS: usize = 4;

    /// [`super::moe_gemv`]: `moe_bounds` (each expert's first sorted position, one thread an
    /// expert), then one block per (`GEMV_WARPS` x `MOE_COLS` columns, expert).
    pub(super) fn moe_gemv(
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
        (experts, n, k, slots, in_div): (usize, usize, usize, usize, usize),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (s3, l3): (&CudaStorage, &Layout),
            (experts, n, k, slots, in_div): (usize, usize, usize, usize, usize),
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            let sorted = input::<u32>(s3, l3)?;
            // SAFETY: moe_bounds writes all experts + 1 entries.
            let bounds: CudaSlice<u32> = unsafe { dev.alloc::<u32>(experts + 1)? };
            let func = dev.get_or_load_custom_func("moe_bounds", MODULE, PTX)?;
            let mut builder = func.builder();
            builder.arg(&sorted);
            let (slots_i, experts_i) = (slots as i32, experts as i32);
            builder.arg(&slots_i);
            builder.arg(&experts_i);
            builder.arg(&bounds);
            let cfg = LaunchConfig {
                grid_dim: ((experts + 1).div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: thread e (up to experts) reads the first `slots` ids of sorted (its
            // first row) and writes bounds[e].
            unsafe { builder.launch(cfg) }.w()?;
            // SAFETY: the slots are a permutation (the routing's sort), so the kernel writes
            // every one of the slots x n outputs.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(slots * n)? };
            let (slots_i, in_div_i, n_i, k_i) = (slots as i32, in_div as i32, n as i32, k as i32);
            // The tensor-core kernel (its last argument the slots a group) or the GEMV kernel
            // (the columns a warp); the same arguments else.
            let mma = super::moe_mma_takes(n, k);
            let (name, cfg, last) = if mma {
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(super::MOE_MMA_COLS) as u32, experts as u32, 1),
                    block_dim: (super::MOE_MMA_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                ("moe_mma", cfg, super::moe_mma_group() as i32)
            } else {
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(GEMV_WARPS * MOE_COLS) as u32, experts as u32, 1),
                    block_dim: ((32 * GEMV_WARPS) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                ("moe_gemv", cfg, MOE_COLS as i32)
            };
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let mut builder = func.builder();
            builder.arg(&x);
            builder.arg(&w);
            builder.arg(&sorted);
            builder.arg(&bounds);
            builder.arg(&y);
            builder.arg(&slots_i);
            builder.arg(&in_div_i);
            builder.arg(&n_i);
            builder.arg(&k_i);
            builder.arg(&last);
            let prefetch_x = i32::from(super::SKINNY_PREFETCH_X.on());
            if mma {
                builder.arg(&prefetch_x);
            }
            // SAFETY: block (b, e) reads expert e's rows of w its columns cover (moe_mma:
            // b * MOE_MMA_COLS.., n a multiple of 16 so a warp's 16 rows are all in or all out,
            // k a multiple of 32; moe_gemv: b * GEMV_WARPS * MOE_COLS.., below n), the slots
            // bounds[e]..bounds[e + 1] of sorted and the rows of x they name (below rows:
            // checked), 16 bytes at a time, and writes those slots' columns of y.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        let a = ((s1, l1), (s2, l2), (s3, l3), (experts, n, k, slots, in_div));
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(a.0, a.1, a.2, a.3),
            candle_core::DType::BF16 => run::<bf16>(a.0, a.1, a.2, a.3),
            other => candle_core::bail!("moe_gemv: {other:?} on CUDA (f16 or bf16)"),
        }
    }

    pub(super) fn skinny_gemm(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        (m, n, k): (usize, usize, usize),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr + candle_core::WithDType>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            (m, n, k): (usize, usize, usize),
        ) -> candle_core::Result<CudaStorage> {
            if !super::built_for_sm90() {
                candle_core::bail!(
                    "skinny_gemm: its kernel needs sm_90 (TMA); these kernels were built for an \
                     older GPU (CUDA_COMPUTE_CAP)"
                );
            }
            let dev = s1.device().clone();
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            // x's rows in tiles of 8: 1, 2, 4 or 8 tiles (a kernel each).
            let x_tiles = m.div_ceil(8).next_power_of_two();
            let func = dev.get_or_load_custom_func(
                &format!("skinny_gemm_{}_t{x_tiles}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let plan = super::skinny_plan(n, k, sms(&dev)?);
            // SAFETY: each tile's outputs are written by its only block or by skinny_reduce.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
            // Per tile and slot an [m, SKINNY_COLS] f32 partial where tiles are cut (one float
            // when none is: unread).
            let tiles = n.div_ceil(super::SKINNY_COLS);
            let partials = if plan.max_slots > 1 {
                tiles * plan.max_slots * m * super::SKINNY_COLS
            } else {
                1
            };
            // SAFETY: skinny_reduce, after the GEMM on the stream, reads what its blocks wrote.
            let partial: CudaSlice<f32> = unsafe { dev.alloc::<f32>(partials)? };
            // The TMA's view of w ([n, k], boxes of SKINNY_COLS rows) and x ([m, k], boxes of
            // all its row tiles), 64 k a box.
            let stream = dev.cuda_stream();
            let (w_ptr, _w_sync) = w.device_ptr(&stream);
            let (x_ptr, _x_sync) = x.device_ptr(&stream);
            let wmap = TensorMap::rows::<T>(w_ptr, n, k, super::SKINNY_COLS as u32)?;
            let xmap = TensorMap::rows::<T>(x_ptr, m, k, (8 * x_tiles) as u32)?;
            // Up to 217 KiB of stages a block: above the 48 KiB a launch gets unasked, and the
            // whole carveout as shared memory.
            let smem = super::skinny_smem_bytes(x_tiles);
            {
                use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute as A;
                func.set_attribute(
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .w()?;
                func.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                    .w()?;
            }
            let cfg = LaunchConfig {
                grid_dim: (plan.blocks as u32, 1, 1),
                block_dim: (super::SKINNY_THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // The plan's split, the last three arguments of both kernels.
            let split =
                [plan.chunks_per_tile, plan.units_per_block, plan.max_slots].map(|v| v as i32);
            let mut builder = func.builder();
            builder.arg(&wmap);
            builder.arg(&xmap);
            builder.arg(&y);
            builder.arg(&partial);
            let ints = [m, n, k].map(|v| v as i32);
            for v in ints.iter().chain(&split) {
                builder.arg(v);
            }
            // SAFETY: the TMA reads boxes of w and x through maps of their exact shapes (what
            // falls outside is zero-filled, not read; rows aligned to 16 bytes: checked);
            // each block writes whole tiles' outputs or its slot of a cut tile's partials
            // (max_slots of them a tile: skinny_plan); w and x outlive the launch (their sync
            // guards are held to here).
            unsafe { builder.launch(cfg) }.w()?;
            if plan.max_slots > 1 {
                // The cut tiles' sums: a thread per four columns of a row of a tile.
                let func = dev.get_or_load_custom_func(
                    &format!("skinny_reduce_{}", suffix(s1.dtype())?),
                    MODULE,
                    PTX,
                )?;
                let threads = tiles * m * super::SKINNY_COLS / 4;
                let cfg = LaunchConfig {
                    grid_dim: (threads.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut builder = func.builder();
                builder.arg(&partial);
                builder.arg(&y);
                let ints = [m as i32, n as i32];
                for v in ints.iter().chain(&split) {
                    builder.arg(v);
                }
                // SAFETY: reads the slots the GEMM wrote for each cut tile (the same plan),
                // writes those tiles' outputs; threads past n return.
                unsafe { builder.launch(cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2, (m, n, k)),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2, (m, n, k)),
            other => candle_core::bail!("skinny_gemm: {other:?} on CUDA (f16 or bf16)"),
        }
    }

    pub(super) fn add_bias_rows(
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> candle_core::Result<()> {
            let dev = s1.device().clone();
            let (rows, cols) = l1.shape().dims2()?;
            let (Some((a, b)), Some(_)) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
                candle_core::bail!("add_bias_rows: inputs must be contiguous")
            };
            if l2.shape().elem_count() != cols {
                candle_core::bail!(
                    "add_bias_rows: bias of {} for {cols} columns",
                    l2.shape().elem_count()
                );
            }
            let bias = input::<T>(s2, l2)?;
            let func = dev.get_or_load_custom_func(
                &format!("add_bias_rows_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let mut y = s1.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            let n = rows * cols;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).min(65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&mut y);
            builder.arg(&bias);
            let (rows, cols) = (rows as i64, cols as i32);
            builder.arg(&rows);
            builder.arg(&cols);
            // SAFETY: the kernel reads the bias and updates the rows x cols outputs in place.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(())
        }
        match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(s1, l1, s2, l2),
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2),
            other => candle_core::bail!("add_bias_rows: unsupported dtype {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused GEMV + SwiGLU's CPU twin is the two twins in turn, and [`linear_swiglu`] on
    /// the CPU is the two ops.
    #[test]
    fn gemv_swiglu_twin_is_the_two_twins() {
        for dtype in [DType::F32, DType::BF16] {
            let x = test_tensor(&[3, 264], 1).to_dtype(dtype).unwrap();
            let w = test_tensor(&[2 * 19, 264], 2).to_dtype(dtype).unwrap();
            let got = gemv_swiglu(&x, &w).unwrap().to_dtype(DType::F32).unwrap();
            let want = super::super::swiglu(&gemv(&x, &w).unwrap())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            assert_eq!(got.dims(), &[3, 19]);
            assert_eq!(max_abs_diff(&got, &want), 0.0, "{dtype:?}");
            let layer = candle_nn::Linear::new(w.clone(), None);
            let via = linear_swiglu(&layer, &x).unwrap();
            let two = super::super::swiglu(&linear(&layer, &x).unwrap()).unwrap();
            assert_eq!(
                max_abs_diff(
                    &via.to_dtype(DType::F32).unwrap(),
                    &two.to_dtype(DType::F32).unwrap()
                ),
                0.0,
                "{dtype:?}: linear_swiglu"
            );
        }
        let odd = gemv_swiglu(&test_tensor(&[1, 8], 1), &test_tensor(&[3, 8], 2));
        assert!(odd.unwrap_err().to_string().contains("even"));
    }

    /// The CPU twin is the product (in f32, to rounding), for every row count the kernel
    /// takes and k with and without a remainder past the unrolled chunks.
    #[test]
    fn gemv_twin_is_the_product() {
        for (m, n, k) in [(1, 5, 8), (2, 33, 264), (3, 7, 1032), (4, 19, 3584)] {
            let (x, w) = (test_tensor(&[m, k], 1), test_tensor(&[n, k], 2));
            let got = gemv(&x, &w).unwrap();
            let want = x.matmul(&w.t().unwrap()).unwrap();
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4 * (k as f32).sqrt(), "m {m} n {n} k {k}: {diff}");
        }
    }

    /// The plan: ranges of equal length over the (tile, chunk) units, one block each and
    /// blocks for every slot of the GPU; whole tiles where the ranges fall on tile ends.
    #[test]
    fn skinny_plan_fills_the_device_with_equal_ranges() {
        // 7B gate/up at 132 SMs: 148 tiles x 56 chunks = 8,288 units over 132 slots.
        let p = skinny_plan(37888, 3584, 132);
        assert_eq!((p.chunks_per_tile, p.units_per_block), (56, 63));
        assert_eq!((p.blocks, p.max_slots), (132, 2));
        // 7B down: 14 tiles x 296 chunks = 4,144 units, 32 a block (a tile over 10 or 11).
        let p = skinny_plan(3584, 18944, 132);
        assert_eq!((p.blocks, p.units_per_block, p.max_slots), (130, 32, 11));
        // 0.5B qkv: 5 tiles x 14 chunks: one chunk a block.
        let p = skinny_plan(1152, 896, 132);
        assert_eq!((p.blocks, p.units_per_block, p.max_slots), (70, 1, 15));
        // 0.5B down: 4 tiles x 76 chunks would give 3 a block and 26 blocks a tile: 6.
        let p = skinny_plan(896, 4864, 132);
        assert_eq!((p.blocks, p.units_per_block, p.max_slots), (51, 6, 14));
        // Whole tiles a block when the ranges fall on tile ends.
        let p = skinny_plan(6 * SKINNY_COLS, 256, 1);
        assert_eq!((p.blocks, p.units_per_block, p.max_slots), (1, 24, 1));
        // Every unit is in exactly one range.
        for (n, k) in [
            (37888, 3584),
            (3584, 18944),
            (1152, 896),
            (9728, 896),
            (80, 96),
        ] {
            let p = skinny_plan(n, k, 132);
            let total = n.div_ceil(SKINNY_COLS) * p.chunks_per_tile;
            assert!(p.blocks * p.units_per_block >= total);
            assert!((p.blocks - 1) * p.units_per_block < total);
        }
    }

    /// The skinny GEMM's twin is the product (in f32, to rounding), and shapes the kernel does
    /// not take are refused with the shapes named.
    #[test]
    fn skinny_twin_is_the_product_and_refuses_other_shapes() {
        for (m, n, k) in [(5, 16, 32), (17, 48, 96), (64, 32, 1024)] {
            let (x, w) = (test_tensor(&[m, k], 1), test_tensor(&[n, k], 2));
            let got = skinny_gemm(&x, &w).unwrap();
            let want = x.matmul(&w.t().unwrap()).unwrap();
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4 * (k as f32).sqrt(), "m {m} n {n} k {k}: {diff}");
        }
        for (m, n, k) in [(5, 16, 48), (5, 20, 32), (65, 16, 32)] {
            let err = skinny_gemm(&test_tensor(&[m, k], 1), &test_tensor(&[n, k], 2)).unwrap_err();
            assert!(err.to_string().contains(&format!("[{m}, {k}]")), "{err}");
        }
    }

    /// A routing of `tokens` tokens to `top_k` of `experts` experts (expert 1 takes more than
    /// four slots, expert 0 none) as [`moe_gemv`] takes it: `[2, slots]` u32, the experts
    /// ascending, then each one's slot; and each slot's expert.
    pub(super) fn test_routing(tokens: usize, top_k: usize, experts: usize) -> (Tensor, Vec<u32>) {
        let expert_of: Vec<u32> = (0..tokens * top_k)
            .map(|s| {
                let (t, j) = (s / top_k, s % top_k);
                if j == 0 {
                    1
                } else {
                    (2 + (t * 7 + j * 3) % (experts - 2)) as u32
                }
            })
            .collect();
        let mut order: Vec<u32> = (0..expert_of.len() as u32).collect();
        order.sort_by_key(|&s| (expert_of[s as usize], s));
        let ids: Vec<u32> = order.iter().map(|&s| expert_of[s as usize]).collect();
        let sorted = Tensor::from_vec(
            [ids, order].concat(),
            (2, tokens * top_k),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        (sorted, expert_of)
    }

    /// The MoE GEMV's twin is each slot's product with its expert's weights (in f32, to
    /// rounding), for the gate/up shape (`x` the tokens) and the down shape (`x` the slots);
    /// an unsorted or repeated routing is refused.
    #[test]
    fn moe_gemv_twin_is_each_slots_product() {
        let (tokens, top_k, experts, n, k) = (6, 3, 5, 12, 264);
        let (sorted, expert_of) = test_routing(tokens, top_k, experts);
        let w = test_tensor(&[experts, n, k], 2);
        for (rows, in_div) in [(tokens, top_k), (tokens * top_k, 1)] {
            let x = test_tensor(&[rows, k], 1);
            let got = moe_gemv(&x, &w, &sorted, in_div).unwrap();
            assert_eq!(got.dims(), &[tokens * top_k, n]);
            for (s, &e) in expert_of.iter().enumerate() {
                let want = x
                    .narrow(0, s / in_div, 1)
                    .unwrap()
                    .matmul(&w.get(e as usize).unwrap().t().unwrap())
                    .unwrap();
                let diff = max_abs_diff(&got.narrow(0, s, 1).unwrap(), &want);
                assert!(
                    diff < 1e-4 * (k as f32).sqrt(),
                    "slot {s} (in_div {in_div}): {diff}"
                );
            }
        }
        let x = test_tensor(&[tokens, k], 1);
        let dev = candle_core::Device::Cpu;
        let unsorted = Tensor::new(&[[2u32, 1, 3], [0, 1, 2]], &dev).unwrap();
        let repeated = Tensor::new(&[[1u32, 2, 3], [0, 0, 2]], &dev).unwrap();
        for bad in [unsorted, repeated] {
            assert!(moe_gemv(&x, &w, &bad, 1).is_err());
        }
        let err = moe_gemv(&test_tensor(&[2, k], 1), &w, &sorted, top_k).unwrap_err();
        assert!(err.to_string().contains("18 slots"), "{err}");
    }

    /// Shapes the kernel does not take are refused with the shapes named.
    #[test]
    fn gemv_refuses_mismatched_or_unaligned_k() {
        let err = gemv(&test_tensor(&[1, 12], 1), &test_tensor(&[3, 12], 2)).unwrap_err();
        assert!(err.to_string().contains("[1, 12]"), "{err}");
        assert!(gemv(&test_tensor(&[1, 16], 1), &test_tensor(&[3, 8], 2)).is_err());
    }
}

#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    /// The GEMV kernel gives its twin's values exactly (f16 and bf16, 1 to 4 rows, k with and
    /// without a remainder past the unrolled chunks, the pipelined loop run many times at the
    /// 7B's k of 18,944, columns past a block's last warp; both kernels, the pipelined one
    /// and the four-loads one), and [`linear`] takes it for few rows (with the bias added
    /// after) and cuBLAS for more.
    #[test]
    fn gemv_kernel_matches_its_twin() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let r =
            |s: &[usize], seed: u64, dtype: DType| test_tensor(s, seed).to_dtype(dtype).unwrap();
        let shapes = [
            (1, 13, 8),
            (2, 300, 264),
            (3, 37, 1032),
            (4, 129, 3584),
            (1, 40, 18944),
            (2, 70, 4104),
        ];
        for ((m, n, k), dtype, pipe) in shapes.into_iter().flat_map(|s| {
            [DType::BF16, DType::F16]
                .into_iter()
                .flat_map(move |d| [(s, d, true), (s, d, false)])
        }) {
            GEMV_PIPE.force(Some(pipe));
            let (x, w) = (r(&[m, k], 3, dtype), r(&[n, k], 4, dtype));
            let want = gemv(&x, &w).unwrap().to_dtype(DType::F32).unwrap();
            let got = gemv(&x.to_device(&dev).unwrap(), &w.to_device(&dev).unwrap())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&candle_core::Device::Cpu)
                .unwrap();
            assert_eq!(
                got.to_vec2::<f32>().unwrap(),
                want.to_vec2::<f32>().unwrap(),
                "{dtype:?} m {m} n {n} k {k} pipelined {pipe}"
            );
        }
        GEMV_PIPE.force(None);
        for dtype in [DType::BF16, DType::F16] {
            // Through linear: 3 rows of a 3-D input take the kernel, the bias added after.
            linear_takes(&dev, dtype, 3, 40, gemv);
        }
    }

    /// [`test_tensor`] in `dtype` on `dev`.
    fn gpu_tensor(dev: &candle_core::Device, shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        test_tensor(shape, seed)
            .to_dtype(dtype)
            .unwrap()
            .to_device(dev)
            .unwrap()
    }

    /// A tensor's values in f32, flat: f16 and bf16 exactly, to compare bits.
    fn values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// The fused decode projection ([`norm_linear`]) gives the unfused ops' bits on the GPU,
    /// the residual sum and the product: f16 and bf16, 1 to 4 rows, with and without a pending
    /// add, plain and with SwiGLU, rows of 896, 1,536 and 3,584 elements (the Qwen2.5 0.5B, 1.5B
    /// and 7B hidden sizes: norms of 4, 6 and 14 warps, a lane's last chunks missing at 1,536),
    /// columns past a block's last warp; and the kernel is what ran (`norm_gemv_takes`).
    #[test]
    fn norm_gemv_kernel_gives_the_unfused_ops_bits() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        // The kernel whatever FLEET_NORM_GEMV says (off by default); the reference below runs
        // the unfused ops itself.
        NORM_GEMV.force(Some(true));
        let r = |s: &[usize], seed: u64, dtype: DType| gpu_tensor(&dev, s, seed, dtype);
        let f = values;
        for dtype in [DType::BF16, DType::F16] {
            for (m, k, n) in [(1, 896, 70), (2, 1536, 33), (3, 3584, 129), (4, 896, 200)] {
                let x = r(&[m, 1, k], 1, dtype);
                let p = r(&[m, 1, k], 2, dtype);
                // Norm weights around 1, as a trained model's.
                let nw = test_tensor(&[k], 3)
                    .affine(0.1, 1.0)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap();
                for swiglu in [false, true] {
                    let rows = if swiglu { 2 * n } else { n };
                    let proj = candle_nn::Linear::new(r(&[rows, k], 4, dtype), None);
                    for pending in [None, Some(&p)] {
                        let what = format!("{dtype:?} m {m} k {k} n {n} swiglu {swiglu}");
                        assert!(
                            norm_gemv_takes(&x, pending, &nw, proj.weight(), swiglu),
                            "{what}"
                        );
                        let (s, y) = norm_linear(&x, pending, (&nw, 1e-6), &proj, swiglu).unwrap();
                        let (ws, wy) =
                            norm_linear_reference(&x, pending, (&nw, 1e-6), &proj, swiglu).unwrap();
                        assert_eq!(y.dims(), wy.dims(), "{what}");
                        assert_eq!(f(&s), f(&ws), "{what}: the residual sum");
                        assert_eq!(f(&y), f(&wy), "{what} pending {}", pending.is_some());
                    }
                }
            }
        }
        NORM_GEMV.force(None);
    }

    /// The GEMV ending in the SwiGLU gives the two kernels' bits (f16 and bf16, 1 to 4 rows,
    /// the 0.5B's and the 7B's gate/up shapes, a grid small enough for the pipelined kernel,
    /// columns past a block's last warp), and [`linear_swiglu`] takes it for few rows and the
    /// two ops for more.
    #[test]
    fn gemv_swiglu_kernel_gives_the_unfused_bits() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let r = |s: &[usize], seed: u64, dtype: DType| gpu_tensor(&dev, s, seed, dtype);
        let f = values;
        for dtype in [DType::BF16, DType::F16] {
            for (m, k, n) in [
                (1, 3584, 18944),
                (2, 896, 4864),
                (3, 264, 13),
                (4, 1536, 300),
            ] {
                let what = format!("{dtype:?} m {m} k {k} n {n}");
                let x = r(&[m, k], 1, dtype);
                let w = r(&[2 * n, k], 2, dtype);
                let fused = gemv_swiglu(&x, &w).unwrap();
                let unfused = super::super::swiglu(&gemv(&x, &w).unwrap()).unwrap();
                assert_eq!(fused.dims(), &[m, n], "{what}");
                assert_eq!(f(&fused), f(&unfused), "{what}");
                let layer = candle_nn::Linear::new(w.clone(), None);
                let via = linear_swiglu(&layer, &x.unsqueeze(1).unwrap()).unwrap();
                assert_eq!(via.dims(), &[m, 1, n], "{what}");
                assert_eq!(f(&via), f(&fused), "{what}: linear_swiglu");
            }
            // More rows than the GEMV takes: cuBLAS and the SwiGLU kernel.
            let x = r(&[8, 896], 3, dtype);
            let layer = candle_nn::Linear::new(r(&[2 * 64, 896], 4, dtype), None);
            let via = linear_swiglu(&layer, &x).unwrap();
            let want =
                super::super::swiglu(&candle_core::Module::forward(&layer, &x).unwrap()).unwrap();
            assert_eq!(f(&via), f(&want), "{dtype:?}: 8 rows");
        }
    }

    /// Held by the tests that force [`MOE_MMA`], [`MOE_MMA16`] or [`SKINNY_PREFETCH_X`]
    /// (process-wide switches), so that a parallel `cargo test` does not run one under the
    /// other's choice.
    static MOE_MMA_SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The MoE GEMV kernel gives its twin's values exactly (f16 and bf16; the gate/up and
    /// down shapes; an expert with more than four slots, one with none; columns past a block's
    /// last warp; rows of 768 to 4104 elements, a lane's last chunks missing).
    #[test]
    fn moe_gemv_kernel_matches_its_twin() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let cpu = candle_core::Device::Cpu;
        let (tokens, top_k, experts, n) = (7, 4, 9, 70);
        let (sorted, _) = super::tests::test_routing(tokens, top_k, experts);
        let _switch = MOE_MMA_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
        for k in [768, 1032, 2056, 4104] {
            for dtype in [DType::BF16, DType::F16] {
                let w = test_tensor(&[experts, n, k], 4).to_dtype(dtype).unwrap();
                for (rows, in_div) in [(tokens, top_k), (tokens * top_k, 1)] {
                    let x = test_tensor(&[rows, k], 3).to_dtype(dtype).unwrap();
                    let want = moe_gemv(&x, &w, &sorted, in_div).unwrap();
                    let on = |t: &Tensor| t.to_device(&dev).unwrap();
                    MOE_MMA.force(Some(false)); // the GEMV kernel, whatever FLEET_MOE_MMA says
                    let got = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    MOE_MMA.force(None);
                    let f = |t: Tensor| {
                        let t = t.to_dtype(DType::F32).unwrap().to_device(&cpu).unwrap();
                        t.to_vec2::<f32>().unwrap()
                    };
                    assert_eq!(f(got), f(want), "k {k} {dtype:?} in_div {in_div}");
                }
            }
        }
    }

    /// [`linear`] on `rows` rows of a 3-D input (64 features in, `out` out, with a bias) gives
    /// `product` (the kernel it should take) with the bias added after, bit for bit.
    fn linear_takes(
        dev: &candle_core::Device,
        dtype: DType,
        rows: usize,
        out: usize,
        product: fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) {
        let r = |s: &[usize], seed: u64| {
            test_tensor(s, seed)
                .to_dtype(dtype)
                .unwrap()
                .to_device(dev)
                .unwrap()
        };
        let layer = candle_nn::Linear::new(r(&[out, 64], 5), Some(r(&[out], 6)));
        let x = r(&[rows, 1, 64], 7);
        let got = linear(&layer, &x).unwrap();
        let want = product(&x.reshape((rows, 64)).unwrap(), layer.weight())
            .unwrap()
            .broadcast_add(layer.bias().unwrap())
            .unwrap()
            .reshape((rows, 1, out))
            .unwrap();
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        assert_eq!(
            f(&got).to_vec1::<f32>().unwrap(),
            f(&want).to_vec1::<f32>().unwrap(),
            "{dtype:?} linear"
        );
    }

    /// `got` within a unit in the last place of `want` in `dtype` (bf16: 8 bits of
    /// significand, f16: 11; at least the smallest normal f16's), plus 2^-18 of `scale` (sum
    /// |x w| of each output) for the f32 sums' own rounding in another order: what a product
    /// summed in the tensor cores' order may differ by. A fragment or slot mixed up is off by
    /// the size of the values themselves.
    fn assert_within_ulp(dtype: DType, got: &[f32], want: &[f32], scale: &[f32], what: &str) {
        let bits = if dtype == DType::BF16 { 8 } else { 11 };
        assert_eq!(got.len(), want.len(), "{dtype:?} {what}");
        for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
            let ulp = w.abs().max(6.1e-5).log2().floor().exp2() / (1 << (bits - 1)) as f32;
            let tol = ulp + s / (1 << 18) as f32;
            assert!(
                (g - w).abs() <= tol,
                "{dtype:?} {what}: element {i}: {g} against {w} (within {tol})"
            );
        }
    }

    /// The MoE GEMV on the tensor cores (`FLEET_MOE_MMA`) agrees with its twin to a unit in
    /// the last place (f16 and bf16; the 30B-A3B's gate/up and down shapes and short ones; an
    /// expert with more than eight slots, one with more than sixteen, one with none; a block's
    /// last warps past `n`); a second launch, and groups of 16 slots (`FLEET_MOE_MMA16`), give
    /// the same bits.
    #[test]
    fn moe_mma_kernel_agrees_with_its_twin() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let cpu = candle_core::Device::Cpu;
        let host = |t: &Tensor| {
            let t = t.to_dtype(DType::F32).unwrap().to_device(&cpu).unwrap();
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let _switch = MOE_MMA_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
        // test_routing gives expert 0 no slot in each case; at 23 tokens the others 14 to 23
        // (groups of 8 and short ones; of 16: one of 9 to 16, or 16 and a short one).
        // (23, 8, 12, 80, 160): a block's dead warps through several groups, and two k chunks
        // of which the second is short.
        for (tokens, top_k, experts, n, k) in [
            (7, 4, 9, 80, 96),
            (23, 8, 12, 80, 160),
            (23, 8, 12, 1536, 2048),
            (5, 8, 12, 2048, 768),
        ] {
            let (sorted, _) = super::tests::test_routing(tokens, top_k, experts);
            for dtype in [DType::BF16, DType::F16] {
                let w = test_tensor(&[experts, n, k], 4).to_dtype(dtype).unwrap();
                for (rows, in_div) in [(tokens, top_k), (tokens * top_k, 1)] {
                    let x = test_tensor(&[rows, k], 3).to_dtype(dtype).unwrap();
                    let want = host(&moe_gemv(&x, &w, &sorted, in_div).unwrap());
                    let abs = |t: &Tensor| t.abs().unwrap();
                    let scale = host(&moe_gemv(&abs(&x), &abs(&w), &sorted, in_div).unwrap());
                    let on = |t: &Tensor| t.to_device(&dev).unwrap();
                    // Every variant forced, whatever the defaults are.
                    MOE_MMA.force(Some(true));
                    MOE_MMA16.force(Some(false));
                    SKINNY_PREFETCH_X.force(Some(false));
                    let got = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    let again = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    MOE_MMA16.force(Some(true));
                    let by16 = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    SKINNY_PREFETCH_X.force(Some(true));
                    let by16_prefetched = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    MOE_MMA16.force(Some(false));
                    let prefetched = moe_gemv(&on(&x), &on(&w), &on(&sorted), in_div).unwrap();
                    SKINNY_PREFETCH_X.force(None);
                    MOE_MMA16.force(None);
                    MOE_MMA.force(None);
                    let what = format!("tokens {tokens} n {n} k {k} in_div {in_div}");
                    let got = host(&got);
                    assert_eq!(got, host(&again), "{dtype:?} {what}: not repeatable");
                    assert_eq!(got, host(&by16), "{dtype:?} {what}: groups of 16");
                    assert_eq!(got, host(&prefetched), "{dtype:?} {what}: x prefetched");
                    assert_eq!(got, host(&by16_prefetched), "{dtype:?} {what}: both");
                    assert_within_ulp(dtype, &got, &want, &scale, &what);
                }
            }
        }
    }

    /// The skinny GEMM kernel agrees with its twin to a unit in the last place of the dtype
    /// (the tensor cores sum in their own order; both accumulate in f32 and round once), for
    /// every row-tile count (5 to 64 rows, rows past a tile's last padded), one split and many
    /// (the last split sums them), blocks whose units cross tile ends, fewer units than
    /// pipeline stages, columns past a block's last warp, k with a short last chunk; a second
    /// launch gives the same bits (the sums are in a fixed
    /// order), and [`linear`] takes it for 5 to 64 rows with the bias added after.
    #[test]
    fn skinny_gemm_kernel_agrees_with_its_twin() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let r =
            |s: &[usize], seed: u64, dtype: DType| test_tensor(s, seed).to_dtype(dtype).unwrap();
        let host = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .to_device(&candle_core::Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        };
        for dtype in [DType::BF16, DType::F16] {
            // (rows, columns, k): 7B's o and down projections, the 0.5B's down, a qkv shape,
            // and small ones for the edges.
            let shapes = [
                (5, 16, 32),
                (8, 80, 96),
                (13, 4608, 3584),
                (16, 3584, 3584),
                (33, 3584, 18944),
                (64, 896, 4864),
                (64, 9728, 896),
                (32, 1152, 896),
                (24, 37888, 512),
            ];
            for (m, n, k) in shapes {
                let (x, w) = (r(&[m, k], 3, dtype), r(&[n, k], 4, dtype));
                let want = host(&skinny_gemm(&x, &w).unwrap());
                // sum_k |x w|: the scale of the f32 sums' rounding, whatever their order.
                let abs = |t: &Tensor| t.to_dtype(DType::F32).unwrap().abs().unwrap();
                let scale = host(&abs(&x).matmul(&abs(&w).t().unwrap()).unwrap());
                let (xd, wd) = (x.to_device(&dev).unwrap(), w.to_device(&dev).unwrap());
                let got = host(&skinny_gemm(&xd, &wd).unwrap());
                let again = host(&skinny_gemm(&xd, &wd).unwrap());
                assert_eq!(got, again, "{dtype:?} m {m} n {n} k {k}: not repeatable");
                // One unit in the last place of |want| in the dtype (bf16: 8 bits of
                // significand, f16: 11; at least the smallest normal f16's), plus 2^-18 of
                // sum |x w| for the f32 sums' own rounding in another order. A fragment or
                // split mixed up is off by the size of the values themselves.
                assert_within_ulp(
                    dtype,
                    &got.concat(),
                    &want.concat(),
                    &scale.concat(),
                    &format!("m {m} n {n} k {k}"),
                );
            }
            // Through linear: 12 rows of a 3-D input take the kernel (switched on for this
            // process), the bias added after.
            set_skinny_gemm(true);
            linear_takes(&dev, dtype, 12, 48, skinny_gemm);
        }
    }

    /// [`linear`]'s in-place bias add gives candle's `Linear` result, in every float dtype,
    /// for 2-D and 3-D inputs.
    #[test]
    fn linear_bias_in_place_matches_candle() {
        use candle_core::Module;
        let dev = candle_core::Device::new_cuda(0).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for shape in [vec![37, 72], vec![3, 41, 72]] {
                let r = |s: &[usize]| {
                    Tensor::randn(0f32, 1.0, s, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let layer = candle_nn::Linear::new(r(&[136, 72]), Some(r(&[136])));
                let x = r(&shape);
                let want = layer.forward(&x).unwrap();
                let got = linear(&layer, &x).unwrap();
                assert_eq!(want.dims(), got.dims());
                let diff = max_abs_diff(&want, &got);
                println!("linear {dtype:?} {shape:?}: max |candle - in place| = {diff}");
                assert_eq!(diff, 0.0, "the bias add rounds differently");
            }
        }
    }
}
