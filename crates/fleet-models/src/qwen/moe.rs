//! The sparse mixture-of-experts MLP of Qwen3-MoE / Qwen3-VL-MoE decoder layers.
//!
//! transformers' `Qwen3VLMoeTextSparseMoeBlock`: router logits `x · Wgᵀ` in the model dtype,
//! softmax in f32, the top-k probabilities renormalised to sum to one (always: transformers
//! does not read `norm_topk_prob` for Qwen3-VL) and cast to the model dtype; each chosen expert
//! computes `down(silu(gate) * up)` with gate the first half of its fused `gate_up`
//! projection, scaled by its routing weight and summed over the chosen experts. There is no
//! shared expert.
//!
//! Four ways to run it, same result up to the order of bf16 roundings:
//! - grouped (every device, every dtype): the routing goes to the host, tokens are grouped by
//!   expert and each expert runs two GEMMs on its tokens — transformers' own loop, so the CPU
//!   parity tests check exactly its arithmetic;
//! - the MoE GEMV (CUDA, bf16/f16, decode-sized calls): routing, sorting and both expert
//!   projections on the device with no host round trip, each touched expert's weights read
//!   once a step ([`ops::moe_gemv`]); the only path a decode step's CUDA graph can record;
//! - candle's fused `moe_gemm` kernels (CUDA, bf16/f16, decode-sized calls with
//!   `FLEET_MOE_GEMV=0`, never inside a graph: their thrust scan allocates outside the pool,
//!   so with it a decode step is not captured and runs op by op);
//! - sorted (CUDA, bf16/f16, from `FLEET_MOE_SORTED_MIN_TOKENS` tokens, default 256): routing
//!   on the device, rows gathered into expert order and one cuBLAS grouped GEMM per
//!   projection (or one GEMM per expert, `FLEET_MOE_GROUPED_GEMM=0`): prefills.
//!
//! `FLEET_MOE_KERNEL=0` turns the GPU paths off (the grouped path everywhere).

use candle_core::{DType, IndexOp, Module, Tensor};
use candle_nn::Linear;

use crate::error::{ModelError, Result};
use crate::ops;
use crate::weights::{Init, Loader, INIT_STD};

/// One MoE block's weights.
pub(crate) struct SparseMoe {
    /// `[experts, hidden]`, no bias.
    router: Linear,
    /// Per expert `[2 * inter, hidden]` (gate rows first), i.e. `F.linear` layout.
    gate_up: Tensor,
    /// Per expert `[hidden, inter]`.
    down: Tensor,
    top_k: usize,
}

/// Tokens per call of the fused kernels: candle sorts the `tokens * top_k` routing entries in
/// one thread block, whose shared memory holds a few thousand entries.
#[cfg(feature = "cuda")]
const KERNEL_CHUNK: usize = 1024;

/// Whether decode-sized calls (up to [`KERNEL_CHUNK`] tokens, below [`SORTED_MIN_TOKENS`]) take
/// [`ops::moe_gemv`] rather than candle's fused kernels: on unless `FLEET_MOE_GEMV=0`. On an
/// H200 (30B-A3B judge, batch 32, op by op) its decode took 5.26 s a batch against the fused
/// kernels' 5.41; and only it can be captured, so the step before a capture must take it too
/// (the capture replays that step's uploads: a path that differs fails the capture).
#[cfg(feature = "cuda")]
static MOE_GEMV: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_MOE_GEMV", true);

/// Whether the sorted path runs each projection as one cuBLAS grouped GEMM
/// ([`ops::grouped_linear`]) instead of one GEMM per expert and a concatenation: on unless
/// `FLEET_MOE_GROUPED_GEMM=0`. On an H200 (30B-A3B judge, 1024 px, batch 32, its prompt passes
/// of three prompts, ~6.4k tokens) the prefill took 6.14 / 6.35 s a batch against the loop's
/// 6.89 / 7.16 (two rounds, alternating).
#[cfg(feature = "cuda")]
static GROUPED_GEMM: crate::ops::EnvSwitch =
    crate::ops::EnvSwitch::new("FLEET_MOE_GROUPED_GEMM", true);

/// From how many tokens a GPU call takes the sorted per-expert GEMMs instead of candle's fused
/// kernels: `FLEET_MOE_SORTED_MIN_TOKENS`, default 256 (decode steps stay on the GEMV, which
/// needs no host round trip; 1 sends every call that is not captured to the sorted path).
#[cfg(feature = "cuda")]
static SORTED_MIN_TOKENS: crate::ops::EnvCount =
    crate::ops::EnvCount::new("FLEET_MOE_SORTED_MIN_TOKENS", 256);

/// How a checkpoint stores each MoE layer's experts.
///
/// | layout | `experts.gate_up_proj` | `experts.down_proj` | used as |
/// |---|---|---|---|
/// | [`Released`](ExpertLayout::Released) | `[E, H, 2I]` | `[E, I, H]` | `x @ W` |
/// | [`Transformers5`](ExpertLayout::Transformers5) | `[E, 2I, H]` | `[E, H, I]` | `F.linear(x, W)` |
///
/// The released checkpoints (Qwen3-VL-30B-A3B and the other hub files, written by transformers
/// 4.57, whose experts computed `x @ W`) hold the first. transformers 5.17 holds the second in
/// memory and converts on load with `Transpose(1, 2, check_dims=True)` per tensor
/// (`conversion_mapping.py`, `"qwen3_vl_moe"`; `core_model_loading.py`, `Transpose.convert`):
/// it transposes a tensor only when the file's shape differs from the parameter's. Its
/// `save_pretrained` applies the reverse op (`revert_weight_conversion`), which compares the
/// in-memory tensor with that same parameter shape, always finds them equal and writes the
/// runtime layout as is: a file transformers 5 saved holds the second layout.
///
/// fleet tells them apart by both tensors' shapes together: a layout is taken only when both
/// match it. `down_proj` decides whenever `I != H` (and `gate_up_proj` must then agree);
/// `gate_up_proj` decides whenever `2I != H`. One tensor can be square and fit both layouts
/// (`gate_up_proj` when `2I == H`, `down_proj` when `I == H`) but never both at once (that
/// needs `I == 0`), so exactly one layout or none fits the pair. transformers' per-tensor check
/// has no such fallback: at `2I == H` it keeps a released file's square `gate_up_proj`
/// untransposed, and at `I == H` its square `down_proj`, and computes with the transposed
/// matrices (scripts/fixtures/make_qwen3_vl_moe_layouts.py records both); files it saved itself
/// it reads back exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertLayout {
    /// The released checkpoints': `[E, H, 2I]` / `[E, I, H]`.
    Released,
    /// transformers 5's runtime layout, which its `save_pretrained` writes: `[E, 2I, H]` /
    /// `[E, H, I]`.
    Transformers5,
}

impl ExpertLayout {
    const BOTH: [ExpertLayout; 2] = [ExpertLayout::Released, ExpertLayout::Transformers5];

    /// The (`gate_up_proj`, `down_proj`) shapes of this layout.
    fn shapes(self, experts: usize, hidden: usize, inter: usize) -> ([usize; 3], [usize; 3]) {
        match self {
            ExpertLayout::Released => ([experts, hidden, 2 * inter], [experts, inter, hidden]),
            ExpertLayout::Transformers5 => ([experts, 2 * inter, hidden], [experts, hidden, inter]),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ExpertLayout::Released => "the released layout",
            ExpertLayout::Transformers5 => "the layout transformers 5 saves",
        }
    }

    /// The layout that both stored shapes match. `Err` names the tensor at fault (`true` for
    /// `gate_up_proj`, `false` for `down_proj`) and says what each layout expects.
    fn detect(
        gate_up: &[usize],
        down: &[usize],
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> std::result::Result<Self, (bool, String)> {
        let shapes = |l: ExpertLayout| l.shapes(experts, hidden, inter);
        if let Some(&l) = Self::BOTH.iter().find(|&&l| {
            let (g, d) = shapes(l);
            gate_up == g && down == d
        }) {
            return Ok(l);
        }
        // What each layout expects of one tensor (`down`: down_proj, else gate_up_proj).
        let expect = |down: bool| {
            let pick = |l: ExpertLayout| if down { shapes(l).1 } else { shapes(l).0 };
            format!(
                "{} expects {:?}, {} {:?}",
                ExpertLayout::Released.describe(),
                pick(ExpertLayout::Released),
                ExpertLayout::Transformers5.describe(),
                pick(ExpertLayout::Transformers5)
            )
        };
        let sizes = format!(
            "num_experts = {experts}, hidden_size = {hidden}, moe_intermediate_size = {inter}"
        );
        // down_proj decides where it can; gate_up_proj must then agree.
        let down_fits: Vec<ExpertLayout> = Self::BOTH
            .into_iter()
            .filter(|&l| down == shapes(l).1)
            .collect();
        let mismatch = "; config.json and the weights are from different models";
        Err(match down_fits.as_slice() {
            [] => (
                false,
                format!(
                    "has shape {down:?}, which fits neither layout of the experts for {sizes} \
                     ({}; gate_up_proj is {gate_up:?}){mismatch}",
                    expect(true)
                ),
            ),
            [l] => {
                let hint = match Self::BOTH.into_iter().find(|&o| gate_up == shapes(o).0) {
                    Some(o) => format!(
                        "; gate_up_proj is in {}: the file mixes the layouts (converted in part)",
                        o.describe()
                    ),
                    None => mismatch.to_string(),
                };
                (
                    true,
                    format!(
                        "has shape {gate_up:?}, but down_proj {down:?} is in {}, where \
                         gate_up_proj is {:?} for {sizes} ({}){hint}",
                        l.describe(),
                        shapes(*l).0,
                        expect(false)
                    ),
                )
            }
            _ => (
                true,
                format!(
                    "has shape {gate_up:?}, which fits neither layout of the experts for {sizes} \
                     ({}; down_proj is {down:?}, square, which fits both){mismatch}",
                    expect(false)
                ),
            ),
        })
    }
}

impl SparseMoe {
    /// Reads `{p}.gate.weight` `[E, H]` and the experts, `{p}.experts.gate_up_proj` and
    /// `{p}.experts.down_proj`, in either [`ExpertLayout`], told apart by both tensors' stored
    /// shapes; they are held as `[E, 2I, H]` / `[E, H, I]` (transformers 5's layout, the rows of
    /// `F.linear`). Random weights have no stored shapes: they are drawn in the released layout.
    /// Shapes that fit neither layout are an error naming the tensor, its shard, both shapes
    /// and what each layout expects.
    pub(crate) fn load(
        ld: &Loader<'_>,
        p: &str,
        hidden: usize,
        experts: usize,
        inter: usize,
        top_k: usize,
    ) -> Result<Self> {
        let (router, _) = ld.linear(&format!("{p}.gate"), hidden, experts, false)?;
        let gate_up_name = format!("{p}.experts.gate_up_proj");
        let down_name = format!("{p}.experts.down_proj");
        let layout = Self::layout(ld, &gate_up_name, &down_name, experts, hidden, inter)?;
        let (gate_up_shape, down_shape) = layout.shapes(experts, hidden, inter);
        let read = |name: &str, shape: [usize; 3]| -> Result<Tensor> {
            let t = ld.tensor(name, &shape, Init::Normal(INIT_STD))?;
            Ok(match layout {
                ExpertLayout::Transformers5 => t,
                ExpertLayout::Released => t.transpose(1, 2)?.contiguous()?,
            })
        };
        let gate_up = read(&gate_up_name, gate_up_shape)?;
        let down = read(&down_name, down_shape)?;
        Ok(SparseMoe {
            router: Linear::new(router, None),
            gate_up,
            down,
            top_k,
        })
    }

    /// The layout of one layer's experts (see [`ExpertLayout`]).
    fn layout(
        ld: &Loader<'_>,
        gate_up_name: &str,
        down_name: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<ExpertLayout> {
        let w = ld.weights;
        // A tensor missing from the checkpoint: reading it reports that, not a layout.
        for name in [gate_up_name, down_name] {
            if !w.contains(name) {
                ld.tensor(name, &[0], Init::Zeros)?;
            }
        }
        let (Some(gate_up), Some(down)) = (w.shape_of(gate_up_name), w.shape_of(down_name)) else {
            // Random weights have no stored shapes: drawn in the released layout.
            return Ok(ExpertLayout::Released);
        };
        ExpertLayout::detect(&gate_up, &down, experts, hidden, inter).map_err(
            |(gate_up_at_fault, message)| {
                let name = if gate_up_at_fault {
                    gate_up_name
                } else {
                    down_name
                };
                ModelError::BadWeights {
                    path: w
                        .shard_of(name)
                        .map(|p| p.to_path_buf())
                        .unwrap_or_default(),
                    message: format!("tensor `{name}` {message}"),
                }
            },
        )
    }

    /// `x` `[b, len, hidden]` -> `[b, len, hidden]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, len, hidden) = x.dims3()?;
        let flat = x.reshape((b * len, hidden))?;
        #[cfg(feature = "cuda")]
        if self.use_kernel(&flat) {
            let n = b * len;
            // A decode step being captured as a CUDA graph takes the MoE GEMV: the sorted path
            // reads the routing to the host, and candle's fused kernels run a thrust scan that
            // allocates outside the pool, which a capture refuses with a C++ exception no Rust
            // code can catch (the 30B-A3B judge aborted so on an H200, 2026-11-28d).
            let capturing = ops::capturing(flat.device())?;
            let out = if n <= KERNEL_CHUNK
                && (capturing || MOE_GEMV.on() && n < SORTED_MIN_TOKENS.get())
            {
                self.forward_gemv(&flat)?
            } else if capturing {
                // The capture fails with this error and the step runs op by op.
                return Err(ModelError::BadInput(format!(
                    "a CUDA graph cannot record the MoE of {n} tokens (at most {KERNEL_CHUNK})"
                )));
            } else if n >= SORTED_MIN_TOKENS.get() {
                self.forward_sorted(&flat)?
            } else {
                self.forward_kernel(&flat)?
            };
            return Ok(out.reshape((b, len, hidden))?);
        }
        Ok(self.forward_grouped(&flat)?.reshape((b, len, hidden))?)
    }

    /// Routing of `x` `[n, hidden]`: for every token its `top_k` experts (most probable first)
    /// and their renormalised weights, on the host.
    fn route(&self, x: &Tensor) -> Result<(Vec<u32>, Vec<f32>)> {
        let logits = self.router.forward(x)?.to_dtype(DType::F32)?;
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let k = self.top_k;
        let mut ids = Vec::with_capacity(rows.len() * k);
        let mut weights = Vec::with_capacity(rows.len() * k);
        for (t, row) in rows.iter().enumerate() {
            if let Some(bad) = row.iter().find(|v| !v.is_finite()) {
                return Err(ModelError::BadInput(format!(
                    "the MoE router's logit for token {t} is {bad}: the activations overflowed \
                     or the router weights are not finite"
                )));
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let probs: Vec<f32> = exp.iter().map(|e| e / sum).collect();
            // torch.topk: largest first; equal values keep the lower index first.
            let mut order: Vec<usize> = (0..probs.len()).collect();
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let top = &order[..k];
            let total: f32 = top.iter().map(|&e| probs[e]).sum();
            for &e in top {
                ids.push(e as u32);
                weights.push(probs[e] / total);
            }
        }
        Ok((ids, weights))
    }

    /// transformers' loop: per expert hit, its tokens through gate/up, SwiGLU, down, scaled by
    /// the routing weight (in the model dtype) and added into the output in expert order.
    fn forward_grouped(&self, x: &Tensor) -> Result<Tensor> {
        let (n, hidden) = x.dims2()?;
        let (ids, weights) = self.route(x)?;
        let experts = self.gate_up.dim(0)?;
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); experts];
        let mut token_w: Vec<Vec<f32>> = vec![Vec::new(); experts];
        for (slot, (&e, &w)) in ids.iter().zip(&weights).enumerate() {
            tokens[e as usize].push((slot / self.top_k) as u32);
            token_w[e as usize].push(w);
        }
        let dev = x.device();
        let mut out = Tensor::zeros((n, hidden), x.dtype(), dev)?;
        for e in 0..experts {
            if tokens[e].is_empty() {
                continue;
            }
            let m = tokens[e].len();
            let idx = Tensor::from_slice(&tokens[e], m, dev)?;
            let xe = x.index_select(&idx, 0)?;
            let gu = xe.matmul(&self.gate_up.i(e)?.t()?)?;
            let act = ops::swiglu(&gu)?;
            let y = act.matmul(&self.down.i(e)?.t()?)?;
            // The routing weights are cast to the model dtype before scaling, as transformers.
            let w = Tensor::from_slice(&token_w[e], (m, 1), dev)?.to_dtype(x.dtype())?;
            let y = y.broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn use_kernel(&self, x: &Tensor) -> bool {
        x.device().is_cuda()
            && matches!(x.dtype(), DType::BF16 | DType::F16)
            && std::env::var("FLEET_MOE_KERNEL").map_or(true, |v| v != "0")
    }

    /// candle's fused MoE GEMMs, in chunks of tokens (see [`KERNEL_CHUNK`]).
    #[cfg(feature = "cuda")]
    fn forward_kernel(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let mut parts = Vec::new();
        let mut start = 0;
        while start < n {
            let m = KERNEL_CHUNK.min(n - start);
            parts.push(self.kernel_chunk(&x.narrow(0, start, m)?)?);
            start += m;
        }
        Ok(if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            Tensor::cat(&parts, 0)?
        })
    }

    /// Routing of `x` `[n, hidden]` on the device: each token's `top_k` experts `[n, k]` (u32,
    /// most probable first) and their renormalised f32 weights `[n, k]`.
    #[cfg(feature = "cuda")]
    fn route_on_device(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        use candle_core::D;
        let probs =
            candle_nn::ops::softmax_last_dim(&self.router.forward(x)?.to_dtype(DType::F32)?)?;
        let top_ids = probs
            .arg_sort_last_dim(false)?
            .narrow(D::Minus1, 0, self.top_k)?
            .contiguous()?;
        let top_w = probs.gather(&top_ids, D::Minus1)?;
        let top_w = top_w.broadcast_div(&top_w.sum_keepdim(D::Minus1)?)?;
        Ok((top_ids, top_w))
    }

    /// Many tokens at once (a prefill) on a GPU: the routing on the device, the (token, expert)
    /// pairs sorted by expert ([`ops::moe_plan`]: on the device, the counts alone read back;
    /// with `FLEET_MOE_DEVICE_PLAN=0` on the host), the rows gathered once into expert order
    /// ([`ops::gather_rows`]), one cuBLAS grouped GEMM over the experts' contiguous rows for
    /// gate/up and again for down ([`ops::grouped_linear`]; or one GEMM per expert), then each
    /// token's rows read back from their sorted positions and summed with their weights
    /// ([`ops::moe_combine`]). candle's fused kernels reach a small fraction of the tensor
    /// cores' rate at thousands of tokens; per-expert GEMMs of hundreds of rows run near it.
    #[cfg(feature = "cuda")]
    fn forward_sorted(&self, x: &Tensor) -> Result<Tensor> {
        use crate::profile;
        let experts = self.gate_up.dim(0)?;
        let dev = x.device();
        // The sub-stages (FLEET_PROFILE): `moe.route` the router, `moe.plan` the sort by
        // expert (its counts read back) and the gather,
        // `moe.gemm_host` the host's time inside the grouped GEMM calls (the enqueueing
        // alone: with FLEET_PROFILE=1 the device is idle before it).
        let (top_ids, top_w) = profile::time(dev, "moe.route", || self.route_on_device(x))?;
        let (
            rows,
            ops::MoePlan {
                counts, position, ..
            },
        ) = profile::time(dev, "moe.plan", || {
            let plan = ops::moe_plan(&top_ids, experts)?;
            Ok((ops::gather_rows(x, &plan.token_of)?, plan))
        })?;
        let mut offsets = Vec::with_capacity(experts);
        let mut total = 0;
        for &c in &counts {
            offsets.push(total);
            total += c;
        }
        let per_expert = |input: &Tensor, weights: &Tensor| -> Result<Tensor> {
            if GROUPED_GEMM.on() {
                let t = profile::enabled().then(std::time::Instant::now);
                let y = ops::grouped_linear(input, weights, &counts)?;
                if let Some(t) = t {
                    profile::record("moe.gemm_host", t.elapsed().as_secs_f64());
                }
                return Ok(y);
            }
            let mut parts = Vec::new();
            for e in (0..experts).filter(|&e| counts[e] > 0) {
                let part = input.narrow(0, offsets[e], counts[e])?;
                parts.push(part.matmul(&weights.i(e)?.t()?)?);
            }
            Ok(Tensor::cat(&parts, 0)?)
        };
        let y = profile::time(dev, "moe.experts", || {
            let gu = per_expert(&rows, &self.gate_up)?; // [n * k, 2I], expert order
            let act = ops::swiglu(&gu)?;
            per_expert(&act, &self.down) // [n * k, hidden], expert order
        })?;
        profile::time(dev, "moe.combine", || {
            ops::moe_combine(&y, &top_w, Some(&position))
        })
    }

    /// A decode step on a GPU without a host round trip: the routing on the device, the slots
    /// sorted by expert there, then [`ops::moe_gemv`] for gate/up and again for down — each
    /// touched expert's weights read once for up to eight of its slots (four on the GEMV
    /// kernel) — and each token's rows scaled by their routing weights (in the model dtype, as
    /// transformers) and summed ([`ops::moe_combine`]).
    #[cfg(feature = "cuda")]
    fn forward_gemv(&self, x: &Tensor) -> Result<Tensor> {
        let k = self.top_k;
        let (top_ids, top_w) = self.route_on_device(x)?;
        let (experts, slots) = top_ids.flatten_all()?.sort_last_dim(true)?;
        let sorted = Tensor::stack(&[&experts, &slots], 0)?; // [2, n * k]
        let gu = ops::moe_gemv(&x.contiguous()?, &self.gate_up, &sorted, k)?; // [n * k, 2I]
        let act = ops::swiglu(&gu)?;
        let y = ops::moe_gemv(&act, &self.down, &sorted, 1)?; // [n * k, hidden], slot order
        ops::moe_combine(&y, &top_w, None)
    }

    #[cfg(feature = "cuda")]
    fn kernel_chunk(&self, x: &Tensor) -> Result<Tensor> {
        use candle_nn::moe::moe_gemm;
        let (n, hidden) = x.dims2()?;
        let k = self.top_k;
        let (top_ids, top_w) = self.route_on_device(x)?;
        let (expert_ids, sorted_token_ids) = top_ids.flatten_all()?.sort_last_dim(true)?;
        let prefill = n > 1;
        // candle's moe_gemm reads its input from the start of the storage, ignoring a view's
        // offset: the normed input arrives as the second half of add_rms_norm's output, so
        // give it a buffer of its own.
        let x = if x.is_contiguous() && x.layout().start_offset() == 0 {
            x.clone()
        } else {
            x.force_contiguous()?
        };
        let gu = moe_gemm(
            &x,
            &self.gate_up,
            &None,
            &sorted_token_ids,
            &expert_ids,
            k,
            prefill,
        )?; // [n * k, 2I]
        let act = ops::swiglu(&gu)?; // [n * k, I]
        let y = moe_gemm(
            &act,
            &self.down,
            &Some(top_w.contiguous()?),
            &sorted_token_ids,
            &expert_ids,
            k,
            prefill,
        )?; // [n * k, hidden], already weighted
        Ok(y.reshape((n, k, hidden))?.sum(1)?)
    }
}

/// Layout detection, and loading from every kind of [`crate::weights::Weights`].
#[cfg(test)]
mod layout_tests {
    use std::collections::HashMap;

    use candle_core::Device;

    use super::*;
    use crate::weights::Weights;

    const E: usize = 4;
    const H: usize = 16;

    fn detect(
        gate_up: [usize; 3],
        down: [usize; 3],
        inter: usize,
    ) -> std::result::Result<ExpertLayout, (bool, String)> {
        ExpertLayout::detect(&gate_up, &down, E, H, inter)
    }

    #[test]
    fn both_shapes_decide_the_layout() {
        use ExpertLayout::*;
        // Neither tensor square (I = 4), gate_up square (2I = H, I = 8), down square (I = H).
        for inter in [4, 8, 16] {
            for l in ExpertLayout::BOTH {
                let (g, d) = l.shapes(E, H, inter);
                assert_eq!(detect(g, d, inter), Ok(l), "I = {inter}");
            }
        }
        // 2I == H: gate_up [4, 16, 16] fits both; down decides.
        assert_eq!(detect([E, H, H], [E, 8, H], 8), Ok(Released));
        assert_eq!(detect([E, H, H], [E, H, 8], 8), Ok(Transformers5));
        // I == H: down [4, 16, 16] fits both; gate_up decides.
        assert_eq!(detect([E, H, 2 * H], [E, H, H], H), Ok(Released));
        assert_eq!(detect([E, 2 * H, H], [E, H, H], H), Ok(Transformers5));
    }

    #[test]
    fn shapes_in_no_layout_name_the_tensor_and_both_layouts() {
        // down in transformers 5's layout, gate_up in the released one: gate_up is at fault.
        let (gate_up_at_fault, m) = detect([E, H, 8], [E, H, 4], 4).unwrap_err();
        assert!(gate_up_at_fault, "{m}");
        for s in [
            "[4, 16, 8]",
            "[4, 16, 4]",
            "[4, 8, 16]",
            "transformers 5 saves",
            "released",
            "mixes the layouts",
        ] {
            assert!(m.contains(s), "{s}: {m}");
        }
        // down fits neither layout.
        let (gate_up_at_fault, m) = detect([E, 8, H], [E, 5, H], 4).unwrap_err();
        assert!(!gate_up_at_fault, "{m}");
        for s in ["[4, 5, 16]", "[4, 4, 16]", "[4, 16, 4]", "[4, 8, 16]"] {
            assert!(m.contains(s), "{s}: {m}");
        }
        // I == H: down square fits both, gate_up fits neither.
        let (gate_up_at_fault, m) = detect([E, H, H], [E, H, H], H).unwrap_err();
        assert!(gate_up_at_fault, "{m}");
        for s in ["[4, 16, 16]", "[4, 16, 32]", "[4, 32, 16]", "fits both"] {
            assert!(m.contains(s), "{s}: {m}");
        }
    }

    fn load(weights: &Weights, inter: usize) -> Result<SparseMoe> {
        let ld = Loader {
            weights,
            dtype: DType::F32,
            device: &Device::Cpu,
        };
        SparseMoe::load(&ld, "mlp", H, E, inter, 2)
    }

    /// The same experts stored in both layouts load to the same tensors, at every shape.
    #[test]
    fn trained_tensors_load_in_either_layout() {
        let dev = Device::Cpu;
        for inter in [4, 8, 16] {
            let gate_up = Tensor::randn(0f32, 1.0, (E, 2 * inter, H), &dev).unwrap();
            let down = Tensor::randn(0f32, 1.0, (E, H, inter), &dev).unwrap();
            let router = Tensor::randn(0f32, 1.0, (E, H), &dev).unwrap();
            for released in [false, true] {
                let t = |x: &Tensor| {
                    if released {
                        x.transpose(1, 2).unwrap().contiguous().unwrap()
                    } else {
                        x.clone()
                    }
                };
                let w = Weights::Tensors(HashMap::from([
                    ("mlp.gate.weight".to_string(), router.clone()),
                    ("mlp.experts.gate_up_proj".to_string(), t(&gate_up)),
                    ("mlp.experts.down_proj".to_string(), t(&down)),
                ]));
                let m = load(&w, inter).unwrap();
                let same = |a: &Tensor, b: &Tensor| {
                    a.dims() == b.dims()
                        && (a - b)
                            .unwrap()
                            .abs()
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap()
                            == 0.0
                };
                assert!(
                    same(&m.gate_up, &gate_up),
                    "I = {inter} released = {released}"
                );
                assert!(same(&m.down, &down), "I = {inter} released = {released}");
            }
        }
    }

    /// Random weights (benchmarks) have no stored shapes: drawn in the released layout, held
    /// transposed, the same draw as before the layouts were told apart.
    #[test]
    fn random_weights_load_at_every_shape() {
        let w = Weights::Random { seed: 7 };
        for inter in [4, 8, 16] {
            let m = load(&w, inter).unwrap();
            assert_eq!(m.gate_up.dims(), &[E, 2 * inter, H]);
            assert_eq!(m.down.dims(), &[E, H, inter]);
            let drawn = w
                .get(
                    "mlp.experts.down_proj",
                    &[E, inter, H],
                    Init::Normal(INIT_STD),
                    DType::F32,
                    &Device::Cpu,
                )
                .unwrap()
                .transpose(1, 2)
                .unwrap();
            let d: f32 = (&m.down - drawn)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert_eq!(d, 0.0);
        }
    }

    /// A missing expert tensor is reported as missing, not as a layout mismatch.
    #[test]
    fn a_missing_expert_tensor_is_named() {
        let dev = Device::Cpu;
        let w = Weights::Tensors(HashMap::from([
            (
                "mlp.gate.weight".to_string(),
                Tensor::zeros((E, H), DType::F32, &dev).unwrap(),
            ),
            (
                "mlp.experts.gate_up_proj".to_string(),
                Tensor::zeros((E, 8, H), DType::F32, &dev).unwrap(),
            ),
        ]));
        let e = load(&w, 4).err().unwrap().to_string();
        assert!(
            e.contains("mlp.experts.down_proj") && e.contains("not among"),
            "{e}"
        );
    }
}

/// On a GPU: candle's fused kernels, the sorted GEMMs and the MoE GEMV against the grouped
/// path, on random weights of several shapes (run on the GPU machine: `cargo test --features
/// cuda -p fleet-models moe_kernel`).
#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    fn moe(e: usize, h: usize, i: usize, k: usize, dev: &candle_core::Device) -> SparseMoe {
        let dt = DType::BF16;
        let r = |s: &[usize]| {
            Tensor::randn(0f32, 0.05, s, dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
        };
        SparseMoe {
            router: Linear::new((r(&[e, h]) * 20.0).unwrap(), None),
            gate_up: r(&[e, 2 * i, h]),
            down: r(&[e, h, i]),
            top_k: k,
        }
    }

    #[test]
    fn moe_kernel_matches_grouped() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        for &(n, e, h, i, k) in &[
            (1, 8, 64, 32, 2),
            (7, 8, 64, 32, 2),
            (64, 128, 2048, 768, 8),
            (578, 128, 2048, 768, 8),
            (3, 128, 2048, 768, 8),
            (4000, 128, 2048, 768, 8),
        ] {
            let m = moe(e, h, i, k, &dev);
            let x = Tensor::randn(0f32, 1.0, (n, h), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            // As the decoder feeds it: the second half of one buffer (a view with an offset).
            let both = Tensor::stack(&[&x, &x], 0).unwrap();
            let view = both.get(1).unwrap();
            let a = m.forward_grouped(&x).unwrap().to_dtype(DType::F32).unwrap();
            let diff_to = |t: Result<Tensor>| crate::ops::max_abs_diff(&a, &t.unwrap());
            let diff = diff_to(m.forward_kernel(&view));
            GROUPED_GEMM.force(Some(false));
            let diff_sorted = diff_to(m.forward_sorted(&view));
            GROUPED_GEMM.force(Some(true));
            let diff_grouped_gemm = diff_to(m.forward_sorted(&view));
            GROUPED_GEMM.force(None);
            let diff_gemv = (n <= KERNEL_CHUNK).then(|| diff_to(m.forward_gemv(&view)));
            let scale = crate::ops::max_abs(&a);
            println!(
                "n={n} e={e} h={h} i={i} k={k}: max|grouped-kernel| = {diff}, \
                 max|grouped-sorted| = {diff_sorted} ({diff_grouped_gemm} with the grouped \
                 GEMM), max|grouped-gemv| = {diff_gemv:?} \
                 (max|grouped| = {scale})"
            );
            if let Some(d) = diff_gemv {
                assert!(d <= 0.02 * scale, "the MoE GEMV differs by {d}");
            }
            assert!(diff <= 0.02 * scale, "fused kernels differ by {diff}");
            assert!(
                diff_sorted <= 0.02 * scale,
                "sorted GEMMs differ by {diff_sorted}"
            );
            assert!(
                diff_grouped_gemm <= 0.02 * scale,
                "the sorted path's grouped GEMM differs by {diff_grouped_gemm}"
            );
        }
    }

    /// A decode step's MoE recorded in a CUDA graph (as the paged decode captures it) and
    /// replayed on new inputs gives the GEMV's output run eagerly, bit for bit; before the fix
    /// the capture reached candle's fused kernels, whose thrust scan aborted the process.
    #[test]
    fn moe_in_a_cuda_graph_replays_the_gemv() {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let cuda = dev.as_cuda_device().unwrap().clone();
        let (n, e, h, i, k) = (32, 128, 2048, 768, 8);
        let m = moe(e, h, i, k, &dev);
        let draw = || {
            Tensor::randn(0f32, 1.0, (1, n, h), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let x = draw();
        let out = Tensor::zeros((1, n, h), DType::BF16, &dev).unwrap();
        // As the decode captures: candle's uploads of kernel parameters cached, then one eager
        // call (kernels loaded, the uploads made) before the capture replays it.
        let _uploads = cuda.enable_cuda_graph_htod_cache();
        out.slice_set(&m.forward(&x).unwrap(), 0, 0).unwrap();
        dev.synchronize().unwrap();
        let stream = cuda.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let recorded = m.forward(&x).and_then(|y| Ok(out.slice_set(&y, 0, 0)?));
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("the capture recorded the MoE");
        recorded.unwrap();
        for round in 0..2 {
            let fresh = draw();
            x.slice_set(&fresh, 0, 0).unwrap();
            graph.launch().unwrap();
            let want = m
                .forward_gemv(&fresh.reshape((n, h)).unwrap())
                .unwrap()
                .reshape((1, n, h))
                .unwrap();
            let d = crate::ops::max_abs_diff(&out, &want);
            assert_eq!(d, 0.0, "replay {round}: the graph's MoE differs by {d}");
        }
    }
}
