//! AdamW as `torch.optim.AdamW` computes it, gradient clipping as
//! `torch.nn.utils.clip_grad_norm_`, HF transformers' learning-rate schedules, and the
//! optimizer state as named tensors for checkpoints.
//!
//! Written here rather than taken from candle-nn because a checkpoint must save and restore the
//! moments exactly, and candle-nn's are private.
//!
//! # AdamW (torch, single-tensor path, `amsgrad=False`, `maximize=False`)
//!
//! For each parameter with a gradient `g`, at its step `t` (counted per parameter, as torch
//! does; a parameter without a gradient is skipped and its step does not advance):
//!
//! ```text
//! p  ← p · (1 − lr·weight_decay)                  (decoupled decay, only if weight_decay ≠ 0)
//! m  ← m + (1 − β1)·(g − m)                         (torch's lerp)
//! v  ← v·β2 + (1 − β2)·g·g
//! p  ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)
//! ```
//!
//! The scalars are computed in f64 and applied as f32, as torch applies Python floats, and the
//! operations are done in torch's order (the tests check a step bit for bit against a scalar f32
//! emulation of torch's CPU kernels). Moments are held in the parameter's dtype (as torch holds
//! them); a parameter of another dtype than f32 is updated in f32 and rounded back (there is no
//! f32 master copy: keep trained parameters in f32 when updates are smaller than the dtype's
//! resolution). On a GPU an f32 parameter, or a bf16 one with a bf16 gradient, takes one fused
//! in-place kernel (the same bits as the composed step); otherwise the
//! composed update runs in slices of the first dimension, in place, so that its f32
//! temporaries stay small however large the parameter.
//!
//! # Schedules (HF `get_*_schedule_with_warmup`)
//!
//! [`LrSchedule::lr`] at `step` (the number of optimizer steps already taken) is the learning
//! rate of the next step: `base_lr · λ(step)`, with linear warm-up `step / max(1, warmup)` for
//! `step < warmup`, then `1` (constant), `max(0, (total − step) / max(1, total − warmup))`
//! (linear) or `max(0, ½(1 + cos(π · progress)))` with
//! `progress = (step − warmup) / max(1, total − warmup)` (cosine). As in HF, the first step
//! after a warm-up of `w > 0` steps runs at lr 0. (HF logs `learning_rate` after the scheduler
//! has stepped, i.e. the rate of the *next* step; the trainer should log the rate it used.)

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::config::{GspoConfig, LrSchedulerType};

/// Errors of the optimizer, clipping, schedules and optimizer state. Each names the parameter,
/// tensor or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// [`AdamW::rebind`] was given another parameter than the one in its place.
    #[error("rebinding the optimizer: `{name}` is not {expected} (name, shape, and the dtype of a parameter this process updates must stay)")]
    Rebind {
        /// The parameter given.
        name: String,
        /// What was in its place.
        expected: String,
    },
    /// Two parameters with one name.
    #[error("parameter name `{name}` is used twice: names key the optimizer state, give each parameter its own")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A parameter that is not floating point.
    #[error("parameter `{name}` is {dtype:?}: only floating-point parameters can be trained")]
    NotFloat {
        /// The parameter.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A hyper-parameter out of range.
    #[error("{field} = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value.
        value: f64,
        /// The range.
        expected: &'static str,
    },
    /// A gradient for a parameter name the optimizer does not have.
    #[error("gradient for `{name}`, which is not a parameter of this optimizer: check the parameter names")]
    UnknownParam {
        /// The name.
        name: String,
    },
    /// Gradients for another number of parameters.
    #[error("got {got} gradients for {expected} parameters: build them with AdamW::gradients")]
    GradCount {
        /// Parameters.
        expected: usize,
        /// Gradients.
        got: usize,
    },
    /// A gradient whose shape is not its parameter's.
    #[error("gradient of `{name}` has shape {got:?}, the parameter {expected:?}")]
    GradShape {
        /// The parameter.
        name: String,
        /// The parameter's shape.
        expected: Vec<usize>,
        /// The gradient's shape.
        got: Vec<usize>,
    },
    /// The global gradient norm is NaN or infinite (the gradients are left untouched).
    #[error("the global gradient norm is {norm}: a NaN or infinite gradient; skip this optimizer step (and look for a NaN loss)")]
    NonFiniteGradNorm {
        /// The norm.
        norm: f64,
    },
    /// A saved state without an entry this optimizer needs.
    #[error("optimizer state has no `{key}`: the checkpoint was made for other parameters; resume with the same model, or start the optimizer afresh")]
    MissingState {
        /// The missing key.
        key: String,
    },
    /// A saved state entry of the wrong shape or dtype.
    #[error("optimizer state `{key}` has shape {got:?} ({dtype:?}), expected {expected:?}: the checkpoint was made for another model")]
    StateShape {
        /// The key.
        key: String,
        /// The shape expected.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
        /// The dtype found.
        dtype: DType,
    },
    /// Saved state entries that no parameter of this optimizer has.
    #[error("optimizer state has entries for parameters this model does not have ({keys}): the checkpoint was made for another model")]
    UnexpectedState {
        /// The first few keys.
        keys: String,
    },
    /// Reading or writing the state file failed.
    #[error("cannot {action} optimizer state {}: {message}", path.display())]
    File {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed in the optimizer: {0}")]
    Candle(#[from] candle_core::Error),
}

/// AdamW hyper-parameters other than the learning rate (which comes from the schedule at each
/// step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β1 (0.9).
    pub beta1: f64,
    /// β2 (0.999).
    pub beta2: f64,
    /// eps (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0).
    pub weight_decay: f64,
}

impl From<&GspoConfig> for AdamWConfig {
    fn from(c: &GspoConfig) -> Self {
        AdamWConfig {
            beta1: c.adam_beta1,
            beta2: c.adam_beta2,
            eps: c.adam_epsilon,
            weight_decay: c.weight_decay,
        }
    }
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

fn range(
    ok: bool,
    field: &'static str,
    value: f64,
    expected: &'static str,
) -> Result<(), OptimError> {
    if ok {
        Ok(())
    } else {
        Err(OptimError::OutOfRange {
            field,
            value,
            expected,
        })
    }
}

impl AdamWConfig {
    fn validate(&self) -> Result<(), OptimError> {
        for (field, v) in [("adam_beta1", self.beta1), ("adam_beta2", self.beta2)] {
            range(
                v.is_finite() && (0.0..1.0).contains(&v),
                field,
                v,
                "0 <= beta < 1",
            )?;
        }
        range(
            self.eps.is_finite() && self.eps >= 0.0,
            "adam_epsilon",
            self.eps,
            "0 or more",
        )?;
        let wd = self.weight_decay;
        range(wd.is_finite() && wd >= 0.0, "weight_decay", wd, "0 or more")
    }
}

/// Gradients of an optimizer's parameters, by parameter index (`None`: no gradient).
#[derive(Debug, Clone, Default)]
pub struct Gradients {
    grads: Vec<Option<Tensor>>,
}

impl Gradients {
    /// Gradients from a list aligned with the optimizer's parameters.
    pub fn new(grads: Vec<Option<Tensor>>) -> Self {
        Gradients { grads }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// The gradient of parameter `i`.
    pub fn get(&self, i: usize) -> Option<&Tensor> {
        self.grads.get(i).and_then(Option::as_ref)
    }

    /// The entries.
    pub fn iter(&self) -> impl Iterator<Item = Option<&Tensor>> {
        self.grads.iter().map(Option::as_ref)
    }

    /// Indices of the entries that hold a NaN or an infinity (at most `limit` of them), for an
    /// error that names the parameters.
    pub fn non_finite(&self, limit: usize) -> Result<Vec<usize>, OptimError> {
        let mut out = Vec::new();
        for (i, g) in self.grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let sum = g
                .to_dtype(candle_core::DType::F32)?
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?;
            if !sum.is_finite() {
                out.push(i);
                if out.len() == limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Adds `other` entry by entry (gradient accumulation over micro-batches).
    pub fn accumulate(&mut self, other: &Gradients) -> Result<(), OptimError> {
        if self.grads.is_empty() {
            self.grads = other.grads.clone();
            return Ok(());
        }
        if other.len() != self.len() {
            return Err(OptimError::GradCount {
                expected: self.len(),
                got: other.len(),
            });
        }
        for (mine, theirs) in self.grads.iter_mut().zip(&other.grads) {
            *mine = match (mine.take(), theirs) {
                (Some(a), Some(b)) => Some((a + b)?),
                (a, b) => a.or_else(|| b.clone()),
            };
        }
        Ok(())
    }

    /// Multiplies every gradient by `factor`, in place.
    pub fn scale(&mut self, factor: f64) -> Result<(), OptimError> {
        for g in self.grads.iter_mut().flatten() {
            map_in_place(g, |s| s.affine(factor, 0.0))?;
        }
        Ok(())
    }
}

/// A contiguous tensor of `t`'s values that shares storage with nothing (`copy` alone keeps a
/// view's strides; `contiguous` alone returns a contiguous tensor itself).
fn owned_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.is_contiguous() {
        t.copy()
    } else {
        t.contiguous()
    }
}

/// The global L2 norm of `grads`: each tensor's sum of squares in f32 (as torch's per-tensor
/// norm), accumulated in f64.
pub fn grad_norm(grads: &Gradients) -> Result<f64, OptimError> {
    // Each gradient's sum of squares stays on its device (one read back per device, not one
    // per parameter), summed over rows first: candle reduces a whole tensor in a single
    // thread block, which is slow for the embedding's hundreds of millions of values.
    let mut per_device: Vec<(candle_core::Device, Vec<Tensor>)> = Vec::new();
    for g in grads.iter().flatten() {
        // In f32 slice by slice inside (a whole f32 copy of a bf16 gradient would be one more
        // tensor of its size).
        let ss = fleet_models::ops::sum_squares(g)?;
        match per_device
            .iter_mut()
            .find(|(d, _)| d.same_device(ss.device()))
        {
            Some((_, v)) => v.push(ss),
            None => per_device.push((ss.device().clone(), vec![ss])),
        }
    }
    let mut total = 0f64;
    for (_, sums) in per_device {
        let v = Tensor::stack(&sums, 0)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        total += v.iter().sum::<f64>();
    }
    Ok(total.sqrt())
}

/// `torch.nn.utils.clip_grad_norm_`: computes the global L2 norm and, when
/// `max_norm / (norm + 1e-6) < 1`, multiplies every gradient by that factor. Returns the norm
/// before clipping. A NaN or infinite norm is an error and the gradients are left as they are
/// (torch would scale them to NaN or 0): the trainer should skip the step.
pub fn clip_grad_norm(grads: &mut Gradients, max_norm: f64) -> Result<f64, OptimError> {
    range(
        max_norm.is_finite() && max_norm > 0.0,
        "max_grad_norm",
        max_norm,
        "a positive number (0 means no clipping: do not call clip_grad_norm then)",
    )?;
    let norm = grad_norm(grads)?;
    if !norm.is_finite() {
        return Err(OptimError::NonFiniteGradNorm { norm });
    }
    // torch computes the coefficient on the f32 norm tensor.
    let coef = max_norm as f32 / (norm as f32 + 1e-6);
    if coef < 1.0 {
        for g in grads.grads.iter_mut().flatten() {
            // In place, one pass (one kernel on a GPU): the product candle's multiplication
            // by the coefficient rounded to the gradient's dtype gives, bit for bit.
            if g.is_contiguous() && matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                fleet_models::ops::scale_in_place(g, coef)?;
                continue;
            }
            let c = Tensor::new(coef, g.device())?.to_dtype(g.dtype())?;
            map_in_place(g, |s| s.broadcast_mul(&c))?;
        }
    }
    Ok(norm)
}

/// `t = f(t)` in place, [`COMPOSED_SLICE_ELEMENTS`] elements at a time along the first
/// dimension (`f` elementwise; a tensor that is not contiguous is replaced instead). Gradients
/// are views into one buffer per device (fleet-models' `ParamGrads`): a new tensor per
/// gradient would hold a second copy of them all until the buffer is freed.
fn map_in_place(
    t: &mut Tensor,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<(), OptimError> {
    if !t.is_contiguous() {
        *t = f(t)?;
        return Ok(());
    }
    fleet_models::ops::update_rows_in_place(t, COMPOSED_SLICE_ELEMENTS, |s, _, _| f(s))?;
    Ok(())
}

/// One parameter's moments and step.
#[derive(Debug, Clone)]
struct ParamState {
    step: u64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// AdamW over named parameters (see the module docs).
#[derive(Debug)]
pub struct AdamW {
    params: Vec<(String, Var)>,
    config: AdamWConfig,
    state: Vec<ParamState>,
    /// Which parameters this process updates: all, or its share under ZeRO stage 1
    /// ([`AdamW::shard`]); the others' moments are not held.
    owned: Vec<bool>,
    /// Elements per slice of the composed update ([`COMPOSED_SLICE_ELEMENTS`]; tests make it
    /// small).
    slice_elements: usize,
}

/// Elements per slice of the composed update (the CPU, and parameters the fused GPU kernel does
/// not take): its f32 temporaries — about six slice-sized tensors — stay near 6 x 64 MiB
/// however large the parameter. Whole-tensor temporaries of a 151,936 x 1,536 embedding came to
/// ~5.6 GB, which made the peak of a bf16 run.
const COMPOSED_SLICE_ELEMENTS: usize = 16 << 20;

/// One composed AdamW step of `p` (any float dtype, updated in f32 and rounded back), slice by
/// slice along the first dimension, written in place into `p` and the moments with the same
/// element-wise arithmetic as a whole-tensor update (no reduction crosses a slice, so the result
/// is the same bit for bit).
fn composed_step(
    p: &Tensor,
    g: &Tensor,
    st: &mut ParamState,
    config: &AdamWConfig,
    lr: f64,
    t: f64,
    slice_elements: usize,
) -> Result<(), OptimError> {
    let AdamWConfig {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = *config;
    let dtype = p.dtype();
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = lr / bias_correction1;
    let bc2_sqrt = Tensor::new(bias_correction2.sqrt() as f32, p.device())?;
    // A scalar parameter is one slice of its own, as a [1] view.
    let (p, g, m_all, v_all) = if p.rank() == 0 {
        (
            p.reshape(1)?,
            g.reshape(1)?,
            st.exp_avg.reshape(1)?,
            st.exp_avg_sq.reshape(1)?,
        )
    } else {
        (
            p.clone(),
            g.clone(),
            st.exp_avg.clone(),
            st.exp_avg_sq.clone(),
        )
    };
    let rows = p.dim(0)?;
    let per_row = (p.elem_count() / rows.max(1)).max(1);
    let slice_rows = (slice_elements / per_row).max(1);
    for start in (0..rows).step_by(slice_rows) {
        let n = slice_rows.min(rows - start);
        let mut ps = p.narrow(0, start, n)?.to_dtype(DType::F32)?;
        let gs = g.narrow(0, start, n)?.to_dtype(DType::F32)?;
        if weight_decay != 0.0 {
            ps = ps.affine(1.0 - lr * weight_decay, 0.0)?;
        }
        // The moments are held in the parameter's dtype (as torch keeps them for a bf16
        // parameter) and computed in f32.
        let m0 = m_all.narrow(0, start, n)?.to_dtype(DType::F32)?;
        let v0 = v_all.narrow(0, start, n)?.to_dtype(DType::F32)?;
        // exp_avg.lerp_(grad, 1 - beta1): self + weight * (end - self).
        let m = ((&gs - &m0)?.affine(1.0 - beta1, 0.0)? + &m0)?;
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
        let v = (v0.affine(beta2, 0.0)? + (gs.affine(1.0 - beta2, 0.0)? * &gs)?)?;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = (v.sqrt()?.broadcast_div(&bc2_sqrt)? + eps)?;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        let update = (&m / &denom)?.affine(-step_size, 0.0)?;
        let new_p = (ps + update)?.to_dtype(dtype)?.contiguous()?;
        // Read before written: every value of this slice is computed above, and no later
        // slice reads these rows.
        p.slice_set(&new_p, 0, start)?;
        m_all.slice_set(&m.to_dtype(dtype)?.contiguous()?, 0, start)?;
        v_all.slice_set(&v.to_dtype(dtype)?.contiguous()?, 0, start)?;
    }
    Ok(())
}

/// Key prefixes of the exported state.
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";
const STEP: &str = "step";

impl AdamW {
    /// An optimizer over `params` (unique names, floating point) with zero moments.
    pub fn new(params: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self, OptimError> {
        config.validate()?;
        let mut state = Vec::with_capacity(params.len());
        for (i, (name, var)) in params.iter().enumerate() {
            if params[..i].iter().any(|(n, _)| n == name) {
                return Err(OptimError::DuplicateName { name: name.clone() });
            }
            let dtype = var.dtype();
            if !dtype.is_float() {
                return Err(OptimError::NotFloat {
                    name: name.clone(),
                    dtype,
                });
            }
            // Moments in the parameter's dtype: f32 for f32 masters, bf16 as torch keeps them
            // for a bf16 parameter.
            let zeros = Tensor::zeros(var.shape(), dtype, var.device())?;
            state.push(ParamState {
                step: 0,
                // Two allocations: on a GPU the moments are updated in place.
                exp_avg: zeros.copy()?,
                exp_avg_sq: zeros,
            });
        }
        let owned = vec![true; params.len()];
        Ok(AdamW {
            params,
            config,
            state,
            owned,
            slice_elements: COMPOSED_SLICE_ELEMENTS,
        })
    }

    /// ZeRO stage 1: keeps the moments of the parameters `owned` marks and frees the others';
    /// [`AdamW::step`] then updates only the owned ones (their new values reach the other
    /// processes through the trainer's sync). Step counts are kept for every parameter.
    pub fn shard(&mut self, owned: &[bool]) -> Result<(), OptimError> {
        if owned.len() != self.params.len() {
            return Err(OptimError::GradCount {
                expected: self.params.len(),
                got: owned.len(),
            });
        }
        for ((st, &mine), (_, var)) in self.state.iter_mut().zip(owned).zip(&self.params) {
            if !mine {
                let empty = Tensor::zeros(0, var.dtype(), var.device())?;
                st.exp_avg = empty.clone();
                st.exp_avg_sq = empty;
            }
        }
        self.owned = owned.to_vec();
        Ok(())
    }

    /// Takes `params` (the same names and shapes, in order) in place of the parameters it
    /// was made with: after [`AdamW::shard`], the model may hold the others' shares in a
    /// narrower dtype (ZeRO stage 1's sharded masters), and the optimizer must not keep the
    /// old, wider tensors alive. A parameter this process updates keeps its dtype.
    pub fn rebind(&mut self, params: Vec<(String, Var)>) -> Result<(), OptimError> {
        if params.len() != self.params.len() {
            return Err(OptimError::GradCount {
                expected: self.params.len(),
                got: params.len(),
            });
        }
        for (i, ((name, var), (old, was))) in params.iter().zip(&self.params).enumerate() {
            let same_dtype = !self.owned[i] || var.dtype() == was.dtype();
            if name != old || var.shape() != was.shape() || !same_dtype {
                return Err(OptimError::Rebind {
                    name: name.clone(),
                    expected: format!("{old} {:?} {:?}", was.shape(), was.dtype()),
                });
            }
        }
        self.params = params;
        Ok(())
    }

    /// Whether this process updates each parameter (all unless [`AdamW::shard`]ed).
    pub fn owned(&self) -> &[bool] {
        &self.owned
    }

    /// Parameter `i`'s moments (`exp_avg`, `exp_avg_sq`) and step; the moments are empty for
    /// a parameter another process owns.
    pub fn moments(&self, i: usize) -> Option<(&Tensor, &Tensor, u64)> {
        self.state
            .get(i)
            .map(|st| (&st.exp_avg, &st.exp_avg_sq, st.step))
    }

    /// A state from moments gathered over the processes ([`AdamW::state`]'s layout): `moments`
    /// holds every parameter's `(exp_avg, exp_avg_sq)`, the step counts are this process's.
    pub fn state_from(&self, moments: Vec<(Tensor, Tensor)>) -> Result<OptimizerState, OptimError> {
        let mut tensors = BTreeMap::new();
        for (((name, _), st), (m, v)) in self.params.iter().zip(&self.state).zip(moments) {
            tensors.insert(format!("{EXP_AVG}/{name}"), m);
            tensors.insert(format!("{EXP_AVG_SQ}/{name}"), v);
            tensors.insert(
                format!("{STEP}/{name}"),
                Tensor::new(&[st.step as i64], &Device::Cpu)?,
            );
        }
        Ok(OptimizerState { tensors })
    }

    /// The parameters, in order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The step count of parameter `i` (torch's `state['step']`).
    pub fn param_step(&self, i: usize) -> Option<u64> {
        self.state.get(i).map(|s| s.step)
    }

    /// The gradients of this optimizer's parameters in a backward pass's store, each a copy:
    /// [`clip_grad_norm`] and [`Gradients::scale`] work in place, and two of a store's
    /// gradients may share storage (an addition hands both sides the same gradient).
    pub fn gradients(&self, store: &GradStore) -> Result<Gradients, OptimError> {
        Ok(Gradients::new(
            self.params
                .iter()
                .map(|(_, v)| store.get(v.as_tensor()).map(owned_copy).transpose())
                .collect::<candle_core::Result<_>>()?,
        ))
    }

    /// Gradients keyed by parameter name (parameters not in `grads` have none). A name this
    /// optimizer does not know is an error.
    pub fn gradients_by_name(
        &self,
        grads: &HashMap<String, Tensor>,
    ) -> Result<Gradients, OptimError> {
        if let Some(unknown) = grads
            .keys()
            .find(|k| !self.params.iter().any(|(n, _)| n == *k))
        {
            return Err(OptimError::UnknownParam {
                name: unknown.clone(),
            });
        }
        Ok(Gradients::new(
            self.params
                .iter()
                .map(|(n, _)| grads.get(n).cloned())
                .collect(),
        ))
    }

    /// One AdamW step at learning rate `lr` (from the schedule). Parameters without a gradient
    /// are skipped.
    pub fn step(&mut self, grads: &Gradients, lr: f64) -> Result<(), OptimError> {
        range(
            lr.is_finite() && lr >= 0.0,
            "learning_rate",
            lr,
            "0 or more",
        )?;
        if grads.len() != self.params.len() {
            return Err(OptimError::GradCount {
                expected: self.params.len(),
                got: grads.len(),
            });
        }
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.config;
        for (i, ((name, var), st)) in self.params.iter().zip(self.state.iter_mut()).enumerate() {
            let Some(grad) = grads.get(i) else { continue };
            if !self.owned[i] {
                // Another process updates it (ZeRO stage 1); the count stays in step.
                st.step += 1;
                continue;
            }
            if grad.dims() != var.dims() {
                return Err(OptimError::GradShape {
                    name: name.clone(),
                    expected: var.dims().to_vec(),
                    got: grad.dims().to_vec(),
                });
            }
            // Detached: the moments must not keep the graph a gradient came from (they live for
            // the whole run; a graph kept here would keep every step's activations).
            // In its own dtype: the composed update converts one slice at a time (a whole f32
            // copy of a bf16 embedding gradient would be one more tensor of its size).
            let g = grad.detach();
            st.step += 1;
            let t = st.step as f64;
            // On a GPU: one fused kernel, in place (same arithmetic, one pass).
            let fused = fleet_models::ops::AdamWStep {
                decay: (1.0 - lr * weight_decay) as f32,
                one_minus_beta1: (1.0 - beta1) as f32,
                beta2: beta2 as f32,
                one_minus_beta2: (1.0 - beta2) as f32,
                eps: eps as f32,
                step_size: (lr / (1.0 - beta1.powf(t))) as f32,
                bc2_sqrt: (1.0 - beta2.powf(t)).sqrt() as f32,
            };
            // An f32 parameter takes any gradient as f32; a bf16 one only a bf16 gradient (an
            // f32 gradient rounded to bf16 first would not be the composed step's arithmetic).
            let g_fused = if var.dtype() == DType::F32 {
                g.to_dtype(DType::F32)?
            } else {
                g.clone()
            };
            if fleet_models::ops::adamw_step_(
                var.as_tensor(),
                &g_fused.contiguous()?,
                &st.exp_avg,
                &st.exp_avg_sq,
                fused,
            )? {
                continue;
            }
            composed_step(
                var.as_tensor(),
                &g,
                st,
                &self.config,
                lr,
                t,
                self.slice_elements,
            )?;
        }
        Ok(())
    }

    /// The state as named tensors on the CPU: `exp_avg/<name>`, `exp_avg_sq/<name>` (the
    /// parameter's dtype and shape) and `step/<name>` (i64, shape `[1]`). Saving and restoring
    /// them gives bit-identical further steps.
    pub fn state(&self) -> Result<OptimizerState, OptimError> {
        // Snapshots on the CPU, where they are written: the next step updates the moments in
        // place, and copies on the GPU would double the optimizer's memory there at every
        // checkpoint.
        let snapshot = |t: &Tensor| -> candle_core::Result<Tensor> {
            if t.device().is_cpu() {
                t.copy()
            } else {
                t.to_device(&Device::Cpu)
            }
        };
        let mut tensors = BTreeMap::new();
        for (name, st) in self.params.iter().map(|(n, _)| n).zip(&self.state) {
            tensors.insert(format!("{EXP_AVG}/{name}"), snapshot(&st.exp_avg)?);
            tensors.insert(format!("{EXP_AVG_SQ}/{name}"), snapshot(&st.exp_avg_sq)?);
            tensors.insert(
                format!("{STEP}/{name}"),
                Tensor::new(&[st.step as i64], &Device::Cpu)?,
            );
        }
        Ok(OptimizerState { tensors })
    }

    /// The live state, borrowed: the moments themselves rather than copies, to write a
    /// checkpoint without a second copy of the optimizer's memory (on a GPU,
    /// [`OptimizerState::save`] brings one tensor at a time to the host). The borrow keeps the
    /// optimizer from stepping while the view exists.
    pub fn state_view(&self) -> Result<StateView<'_>, OptimError> {
        let mut tensors = BTreeMap::new();
        for (name, st) in self.params.iter().map(|(n, _)| n).zip(&self.state) {
            tensors.insert(format!("{EXP_AVG}/{name}"), st.exp_avg.clone());
            tensors.insert(format!("{EXP_AVG_SQ}/{name}"), st.exp_avg_sq.clone());
            tensors.insert(
                format!("{STEP}/{name}"),
                Tensor::new(&[st.step as i64], &Device::Cpu)?,
            );
        }
        Ok(StateView {
            state: OptimizerState { tensors },
            _optimizer: std::marker::PhantomData,
        })
    }

    /// Restores a state exported by [`AdamW::state`] for the same parameters. Every entry must
    /// be present with the right shape, and no other entry may be (a checkpoint of another
    /// model is refused rather than half loaded).
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<(), OptimError> {
        let mut restored = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let get = |prefix: &str, dims: &[usize], dtype: DType| -> Result<Tensor, OptimError> {
                let key = format!("{prefix}/{name}");
                let t = state
                    .tensors
                    .get(&key)
                    .ok_or_else(|| OptimError::MissingState { key: key.clone() })?;
                if t.dims() != dims || t.dtype() != dtype {
                    return Err(OptimError::StateShape {
                        key,
                        expected: dims.to_vec(),
                        got: t.dims().to_vec(),
                        dtype: t.dtype(),
                    });
                }
                // A copy of its own: on a GPU the moments are updated in place.
                Ok(t.to_device(var.device())?.copy()?)
            };
            let exp_avg = get(EXP_AVG, var.dims(), var.dtype())?;
            let exp_avg_sq = get(EXP_AVG_SQ, var.dims(), var.dtype())?;
            let step = get(STEP, &[1], DType::I64)?.to_vec1::<i64>()?[0];
            let step = u64::try_from(step).map_err(|_| OptimError::StateShape {
                key: format!("{STEP}/{name}"),
                expected: vec![1],
                got: vec![1],
                dtype: DType::I64,
            })?;
            restored.push(ParamState {
                step,
                exp_avg,
                exp_avg_sq,
            });
        }
        let expected = 3 * self.params.len();
        if state.tensors.len() != expected {
            let known: std::collections::HashSet<String> = self
                .params
                .iter()
                .flat_map(|(n, _)| [EXP_AVG, EXP_AVG_SQ, STEP].map(|p| format!("{p}/{n}")))
                .collect();
            let extra: Vec<&str> = state
                .tensors
                .keys()
                .filter(|k| !known.contains(*k))
                .take(5)
                .map(String::as_str)
                .collect();
            return Err(OptimError::UnexpectedState {
                keys: extra.join(", "),
            });
        }
        self.state = restored;
        Ok(())
    }
}

/// The optimizer's live state ([`AdamW::state_view`]), valid while it borrows the optimizer.
pub struct StateView<'a> {
    state: OptimizerState,
    _optimizer: std::marker::PhantomData<&'a AdamW>,
}

impl std::ops::Deref for StateView<'_> {
    type Target = OptimizerState;

    fn deref(&self) -> &OptimizerState {
        &self.state
    }
}

/// An optimizer state as named tensors (see [`AdamW::state`]).
#[derive(Debug, Clone)]
pub struct OptimizerState {
    /// The tensors by key.
    pub tensors: BTreeMap<String, Tensor>,
}

impl OptimizerState {
    /// Writes the state as safetensors, atomically (temporary file, then rename).
    pub fn save(&self, path: &Path) -> Result<(), OptimError> {
        let err = |message: String| OptimError::File {
            action: "write",
            path: path.to_path_buf(),
            message,
        };
        let name = path
            .file_name()
            .ok_or_else(|| err("the path names no file".into()))?
            .to_string_lossy()
            .into_owned();
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let map: HashMap<&str, Tensor> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        candle_core::safetensors::save(&map, &tmp).map_err(|e| err(e.to_string()))?;
        // safetensors writes through a private (0600) temporary file.
        fleet_runs::set_created_permissions(&tmp).map_err(|e| err(e.to_string()))?;
        std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
    }

    /// Reads a state written by [`OptimizerState::save`] onto `device`.
    pub fn load(path: &Path, device: &Device) -> Result<Self, OptimError> {
        let tensors =
            candle_core::safetensors::load(path, device).map_err(|e| OptimError::File {
                action: "read",
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        Ok(OptimizerState {
            tensors: tensors.into_iter().collect(),
        })
    }
}

/// A learning-rate schedule with warm-up (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// The shape after warm-up.
    pub kind: LrSchedulerType,
    /// The peak learning rate.
    pub base_lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Total optimizer steps.
    pub total_steps: u64,
}

impl LrSchedule {
    /// A schedule; `base_lr` must be positive and `total_steps` at least 1.
    pub fn new(
        kind: LrSchedulerType,
        base_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    ) -> Result<Self, OptimError> {
        range(
            base_lr.is_finite() && base_lr > 0.0,
            "learning_rate",
            base_lr,
            "a positive number",
        )?;
        range(
            total_steps >= 1,
            "total_steps",
            total_steps as f64,
            "at least 1",
        )?;
        Ok(LrSchedule {
            kind,
            base_lr,
            warmup_steps,
            total_steps,
        })
    }

    /// The config's schedule for a run of `total_steps` optimizer steps
    /// ([`GspoConfig::total_optimizer_steps`]).
    pub fn from_config(config: &GspoConfig, total_steps: u64) -> Result<Self, OptimError> {
        Self::new(
            config.lr_scheduler_type,
            config.learning_rate,
            config.warmup_steps_for(total_steps),
            total_steps,
        )
    }

    /// HF's `lr_lambda(step)`.
    pub fn multiplier(&self, step: u64) -> f64 {
        let w = self.warmup_steps;
        if step < w {
            return step as f64 / w.max(1) as f64;
        }
        let total = self.total_steps as f64;
        let after = (self.total_steps.saturating_sub(w)).max(1) as f64;
        match self.kind {
            LrSchedulerType::Constant => 1.0,
            LrSchedulerType::Linear => ((total - step as f64) / after).max(0.0),
            LrSchedulerType::Cosine => {
                let progress = (step - w) as f64 / after;
                (0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * progress).cos())).max(0.0)
            }
        }
    }

    /// The learning rate of the optimizer step that follows `step` completed steps.
    pub fn lr(&self, step: u64) -> f64 {
        self.base_lr * self.multiplier(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(v: &[f32]) -> Var {
        Var::from_tensor(&Tensor::new(v, &Device::Cpu).unwrap()).unwrap()
    }

    fn grads(v: &[&[f32]]) -> Gradients {
        Gradients::new(
            v.iter()
                .map(|g| Some(Tensor::new(*g, &Device::Cpu).unwrap()))
                .collect(),
        )
    }

    fn values(v: &Var) -> Vec<f32> {
        v.as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn non_finite_gradients_are_found_by_index() {
        let dev = Device::Cpu;
        let t = |v: &[f32]| Some(Tensor::new(v, &dev).unwrap());
        let g = Gradients::new(vec![
            t(&[1.0, 2.0]),
            None,
            t(&[f32::NAN, 0.0]),
            t(&[0.5]),
            t(&[f32::INFINITY]),
        ]);
        assert_eq!(g.non_finite(8).unwrap(), vec![2, 4]);
        assert_eq!(g.non_finite(1).unwrap(), vec![2]);
        assert!(Gradients::new(vec![t(&[1.0])])
            .non_finite(8)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn first_step_by_hand() {
        // p0 = 1, g = 0.5, lr = 0.1, wd = 0.01: m̂ = g, v̂ = g², so
        // p1 = 1·(1 − 0.001) − 0.1 · 0.5 / (0.5 + 1e-8) = 0.899000002.
        let p = var(&[1.0]);
        let mut opt = AdamW::new(
            vec![("w".into(), p.clone())],
            AdamWConfig {
                weight_decay: 0.01,
                ..AdamWConfig::default()
            },
        )
        .unwrap();
        opt.step(&grads(&[&[0.5]]), 0.1).unwrap();
        assert!(
            (f64::from(values(&p)[0]) - 0.899_000_002).abs() < 1e-7,
            "{:?}",
            values(&p)
        );
        assert_eq!(opt.param_step(0), Some(1));
    }

    /// torch's single-tensor AdamW on f32 scalars, in its operation order.
    fn torch_f32(
        p: &mut f32,
        m: &mut f32,
        v: &mut f32,
        g: f32,
        step: u64,
        lr: f64,
        c: &AdamWConfig,
    ) {
        if c.weight_decay != 0.0 {
            *p *= (1.0 - lr * c.weight_decay) as f32;
        }
        *m += ((1.0 - c.beta1) as f32) * (g - *m);
        *v = *v * c.beta2 as f32 + (1.0 - c.beta2) as f32 * g * g;
        let bc1 = 1.0 - c.beta1.powf(step as f64);
        let bc2 = 1.0 - c.beta2.powf(step as f64);
        let step_size = lr / bc1;
        let denom = v.sqrt() / (bc2.sqrt() as f32) + c.eps as f32;
        *p += (-step_size) as f32 * (*m / denom);
    }

    /// The same in f64, straight from the formula.
    fn formula_f64(
        p: &mut f64,
        m: &mut f64,
        v: &mut f64,
        g: f64,
        step: u64,
        lr: f64,
        c: &AdamWConfig,
    ) {
        *p *= 1.0 - lr * c.weight_decay;
        *m = c.beta1 * *m + (1.0 - c.beta1) * g;
        *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
        let m_hat = *m / (1.0 - c.beta1.powf(step as f64));
        let v_hat = *v / (1.0 - c.beta2.powf(step as f64));
        *p -= lr * m_hat / (v_hat.sqrt() + c.eps);
    }

    /// The fused kernel against the composed steps (with `--features cuda` on a GPU machine),
    /// for f32 masters and bf16 ones (bf16 gradients and moments): the same bits.
    #[cfg(feature = "cuda")]
    #[test]
    fn fused_gpu_steps_match_the_composed_cpu_steps() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device; not run");
            return;
        };
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let n = 100_003;
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0)
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let start = Tensor::new(init.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let cpu = Var::from_tensor(&start).unwrap();
            let on_gpu = Var::from_tensor(&start.to_device(&gpu).unwrap()).unwrap();
            let mut a = AdamW::new(vec![("w".into(), cpu.clone())], c).unwrap();
            let mut b = AdamW::new(vec![("w".into(), on_gpu.clone())], c).unwrap();
            for step in 0..5u32 {
                let g: Vec<f32> = (0..n)
                    .map(|i| {
                        (((i as u32).wrapping_mul(2654435761) ^ step) % 2000) as f32 / 1000.0 - 1.0
                    })
                    .collect();
                let gc = Tensor::new(g.as_slice(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                a.step(&Gradients::new(vec![Some(gc.clone())]), 1e-3)
                    .unwrap();
                b.step(
                    &Gradients::new(vec![Some(gc.to_device(&gpu).unwrap())]),
                    1e-3,
                )
                .unwrap();
            }
            let (x, y) = (values(&cpu), values(&on_gpu));
            let worst = x
                .iter()
                .zip(&y)
                .map(|(p, q)| (p - q).abs() / (1e-6 + p.abs()))
                .fold(0f32, f32::max);
            eprintln!(
                "fused AdamW on the GPU vs the CPU, {dtype:?}: worst relative difference {worst:.2e}"
            );
            assert!(worst < 1e-6, "{dtype:?}: {worst}");
            let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
            for (k, t) in &sa.tensors {
                let u = sb.tensors[k].to_device(&Device::Cpu).unwrap();
                let d = (t.to_dtype(DType::F64).unwrap() - u.to_dtype(DType::F64).unwrap())
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(d < 1e-6, "{dtype:?} {k}: {d}");
            }
        }
    }

    /// The composed update in slices writes the same bits as in one piece, for matrices,
    /// vectors and scalars, f32 and bf16 (moments and parameters), and keeps its own storage.
    #[test]
    fn sliced_composed_steps_equal_whole_ones() {
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let dev = Device::Cpu;
        let value = |i: usize, salt: usize| {
            ((i.wrapping_mul(7919) ^ salt.wrapping_mul(104729)) % 2001) as f32 / 1000.0 - 1.0
        };
        let shapes: [&[usize]; 3] = [&[37, 11], &[53], &[]];
        for dtype in [DType::F32, DType::BF16] {
            let make = || -> Vec<(String, Var)> {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(k, dims)| {
                        let n: usize = dims.iter().product();
                        let v: Vec<f32> = (0..n).map(|i| value(i, k)).collect();
                        let t = Tensor::from_vec(v, *dims, &dev)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap();
                        (format!("p{k}"), Var::from_tensor(&t).unwrap())
                    })
                    .collect()
            };
            let (whole_params, sliced_params) = (make(), make());
            let mut whole = AdamW::new(whole_params.clone(), c).unwrap();
            let mut sliced = AdamW::new(sliced_params.clone(), c).unwrap();
            // 37 x 11 in slices of 2 rows (the last one short), 53 in slices of 22.
            sliced.slice_elements = 22;
            for step in 0..4 {
                let g = Gradients::new(
                    shapes
                        .iter()
                        .enumerate()
                        .map(|(k, dims)| {
                            let n: usize = dims.iter().product();
                            let v: Vec<f32> = (0..n).map(|i| value(i, 10 * step + k + 7)).collect();
                            Some(Tensor::from_vec(v, *dims, &dev).unwrap())
                        })
                        .collect(),
                );
                whole.step(&g, 1e-2).unwrap();
                sliced.step(&g, 1e-2).unwrap();
            }
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            for ((name, a), (_, b)) in whole_params.iter().zip(&sliced_params) {
                assert_eq!(bits(a.as_tensor()), bits(b.as_tensor()), "{dtype:?} {name}");
                assert_eq!(b.dtype(), dtype);
            }
            let (sa, sb) = (whole.state().unwrap(), sliced.state().unwrap());
            for (k, t) in &sa.tensors {
                assert_eq!(bits(t), bits(&sb.tensors[k]), "{dtype:?} {k}");
            }
            // A step moved every parameter (a test that cannot pass by doing nothing).
            assert_ne!(
                bits(sliced_params[0].1.as_tensor()),
                bits(make()[0].1.as_tensor())
            );
        }
    }

    #[test]
    fn steps_match_torch_adamw() {
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let init = [0.5f32, -1.25, 3.0, 1e-3];
        let gs: [[f32; 4]; 4] = [
            [0.1, -0.2, 0.3, 1e-6],
            [-0.05, -0.1, 0.4, 2e-6],
            [0.2, 0.0, -0.3, -1e-6],
            [0.0, 0.3, 0.1, 0.0],
        ];
        let lrs = [1e-3, 2e-3, 1.5e-3, 5e-4];
        let p = var(&init);
        let mut opt = AdamW::new(vec![("w".into(), p.clone())], c).unwrap();
        let mut t32: Vec<(f32, f32, f32)> = init.iter().map(|&x| (x, 0.0, 0.0)).collect();
        let mut t64: Vec<(f64, f64, f64)> =
            init.iter().map(|&x| (f64::from(x), 0.0, 0.0)).collect();
        for (k, (g, lr)) in gs.iter().zip(lrs).enumerate() {
            opt.step(&grads(&[g]), lr).unwrap();
            for (j, &gj) in g.iter().enumerate() {
                let (p, m, v) = &mut t32[j];
                torch_f32(p, m, v, gj, k as u64 + 1, lr, &c);
                let (p, m, v) = &mut t64[j];
                formula_f64(p, m, v, f64::from(gj), k as u64 + 1, lr, &c);
            }
            let got = values(&p);
            for j in 0..4 {
                assert_eq!(
                    got[j].to_bits(),
                    t32[j].0.to_bits(),
                    "step {k} elem {j}: {} vs {}",
                    got[j],
                    t32[j].0
                );
                assert!((f64::from(got[j]) - t64[j].0).abs() < 1e-6 * (1.0 + t64[j].0.abs()));
            }
        }
    }

    #[test]
    fn parameters_without_gradients_are_skipped() {
        let a = var(&[1.0]);
        let b = var(&[2.0]);
        let mut opt = AdamW::new(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            AdamWConfig::default(),
        )
        .unwrap();
        let g = Gradients::new(vec![
            Some(Tensor::new(&[1.0f32], &Device::Cpu).unwrap()),
            None,
        ]);
        opt.step(&g, 0.1).unwrap();
        assert_eq!(values(&b), vec![2.0]);
        assert_eq!((opt.param_step(0), opt.param_step(1)), (Some(1), Some(0)));
        assert!(matches!(
            opt.step(&grads(&[&[1.0]]), 0.1).unwrap_err(),
            OptimError::GradCount { .. }
        ));
        let wrong = grads(&[&[1.0, 2.0], &[1.0]]);
        assert!(matches!(
            opt.step(&wrong, 0.1).unwrap_err(),
            OptimError::GradShape { .. }
        ));
        assert!(matches!(
            AdamW::new(
                vec![("a".into(), a.clone()), ("a".into(), b)],
                AdamWConfig::default()
            )
            .unwrap_err(),
            OptimError::DuplicateName { .. }
        ));
    }

    #[test]
    fn gradients_from_a_backward_pass() {
        let w = var(&[1.0, 2.0]);
        let opt = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default()).unwrap();
        let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
        let store = loss.backward().unwrap();
        let by_name = HashMap::from([(
            "w".to_string(),
            Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap(),
        )]);
        assert!(opt.gradients_by_name(&by_name).unwrap().get(0).is_some());
        let wrong = HashMap::from([("v".to_string(), Tensor::new(&[1f32], &Device::Cpu).unwrap())]);
        assert!(matches!(
            opt.gradients_by_name(&wrong).unwrap_err(),
            OptimError::UnknownParam { .. }
        ));
        let mut g = opt.gradients(&store).unwrap();
        assert_eq!(g.get(0).unwrap().to_vec1::<f32>().unwrap(), vec![2.0, 4.0]);
        let again = g.clone();
        g.accumulate(&again).unwrap();
        g.scale(0.5).unwrap();
        assert_eq!(g.get(0).unwrap().to_vec1::<f32>().unwrap(), vec![2.0, 4.0]);
    }

    #[test]
    fn gradients_that_share_storage_are_scaled_once_each() {
        // d(a + b)/da and d(a + b)/db are one tensor in the store (candle-core as patched in
        // vendor/); in-place clipping must not scale it twice through the two parameters.
        let (a, b) = (var(&[1.0, 2.0]), var(&[3.0, 4.0]));
        let opt = AdamW::new(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            AdamWConfig::default(),
        )
        .unwrap();
        let loss = (a.as_tensor() + b.as_tensor())
            .unwrap()
            .affine(3.0, 0.0)
            .unwrap()
            .sum_all()
            .unwrap();
        let mut g = opt.gradients(&loss.backward().unwrap()).unwrap();
        // Norm sqrt(4 * 9) = 6: clipped to 1.5 by the factor 0.25.
        let norm = clip_grad_norm(&mut g, 1.5).unwrap();
        assert!((norm - 6.0).abs() < 1e-6);
        for i in 0..2 {
            let v = g.get(i).unwrap().to_vec1::<f32>().unwrap();
            assert!(v.iter().all(|x| (x - 0.75).abs() < 1e-6), "{v:?}");
        }
    }

    #[test]
    fn resuming_from_saved_state_is_bit_identical() {
        let c = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let gs: Vec<Gradients> = (0..5)
            .map(|k| {
                let k = k as f32;
                grads(&[&[0.1 * k - 0.2, 0.3, -0.7 + k], &[1e-3 * k]])
            })
            .collect();
        let init_a = [0.3f32, -0.1, 2.0];
        let straight = (var(&init_a), var(&[0.5]));
        let mut opt = AdamW::new(
            vec![
                ("a".into(), straight.0.clone()),
                ("b".into(), straight.1.clone()),
            ],
            c,
        )
        .unwrap();
        for g in &gs {
            opt.step(g, 1e-2).unwrap();
        }

        let first = (var(&init_a), var(&[0.5]));
        let mut opt1 = AdamW::new(
            vec![("a".into(), first.0.clone()), ("b".into(), first.1.clone())],
            c,
        )
        .unwrap();
        for g in &gs[..2] {
            opt1.step(g, 1e-2).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        opt1.state().unwrap().save(&path).unwrap();
        // A fresh process: parameters from the model checkpoint, moments from the file.
        let resumed = (var(&values(&first.0)), var(&values(&first.1)));
        let mut opt2 = AdamW::new(
            vec![
                ("a".into(), resumed.0.clone()),
                ("b".into(), resumed.1.clone()),
            ],
            c,
        )
        .unwrap();
        opt2.load_state(&OptimizerState::load(&path, &Device::Cpu).unwrap())
            .unwrap();
        assert_eq!(opt2.param_step(0), Some(2));
        for g in &gs[2..] {
            opt2.step(g, 1e-2).unwrap();
        }
        let bits = |v: &Var| values(v).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&resumed.0), bits(&straight.0));
        assert_eq!(bits(&resumed.1), bits(&straight.1));
        let s1 = opt.state().unwrap();
        let s2 = opt2.state().unwrap();
        for (k, t) in &s1.tensors {
            let a = t
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let b = s2.tensors[k]
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            assert_eq!(a, b, "{k}");
        }
    }

    #[test]
    fn state_of_another_model_is_refused() {
        let a = var(&[1.0, 2.0]);
        let opt = AdamW::new(vec![("a".into(), a)], AdamWConfig::default()).unwrap();
        let state = opt.state().unwrap();
        let mut other =
            AdamW::new(vec![("b".into(), var(&[1.0, 2.0]))], AdamWConfig::default()).unwrap();
        assert!(matches!(
            other.load_state(&state).unwrap_err(),
            OptimError::MissingState { .. }
        ));
        let mut wider = AdamW::new(
            vec![("a".into(), var(&[1.0, 2.0, 3.0]))],
            AdamWConfig::default(),
        )
        .unwrap();
        assert!(matches!(
            wider.load_state(&state).unwrap_err(),
            OptimError::StateShape { .. }
        ));
        let mut extra = state.clone();
        extra.tensors.insert(
            "exp_avg/zzz".into(),
            Tensor::new(&[0f32], &Device::Cpu).unwrap(),
        );
        let mut same =
            AdamW::new(vec![("a".into(), var(&[1.0, 2.0]))], AdamWConfig::default()).unwrap();
        let err = same.load_state(&extra).unwrap_err();
        assert!(err.to_string().contains("exp_avg/zzz"), "{err}");
        same.load_state(&state).unwrap();
    }

    #[test]
    fn clipping_follows_torch() {
        // Norm of (3, 4) and (12) is 13.
        let mut g = grads(&[&[3.0, 4.0], &[12.0]]);
        let norm = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((norm - 13.0).abs() < 1e-6);
        let coef = 1.0f32 / (13.0f32 + 1e-6);
        assert_eq!(
            g.get(0).unwrap().to_vec1::<f32>().unwrap(),
            vec![3.0 * coef, 4.0 * coef]
        );
        assert_eq!(
            g.get(1).unwrap().to_vec1::<f32>().unwrap(),
            vec![12.0 * coef]
        );
        let clipped = grad_norm(&g).unwrap();
        assert!((clipped - 1.0).abs() < 1e-6);
        // Below the limit: untouched.
        let mut small = grads(&[&[0.3, 0.4]]);
        assert!((clip_grad_norm(&mut small, 1.0).unwrap() - 0.5).abs() < 1e-7);
        assert_eq!(
            small.get(0).unwrap().to_vec1::<f32>().unwrap(),
            vec![0.3, 0.4]
        );
        // Non-finite: an error, gradients untouched.
        let mut bad = grads(&[&[f32::NAN, 1.0]]);
        assert!(matches!(
            clip_grad_norm(&mut bad, 1.0).unwrap_err(),
            OptimError::NonFiniteGradNorm { .. }
        ));
        assert_eq!(bad.get(0).unwrap().to_vec1::<f32>().unwrap()[1], 1.0);
        assert!(matches!(
            clip_grad_norm(&mut small, 0.0).unwrap_err(),
            OptimError::OutOfRange { .. }
        ));
    }

    #[test]
    fn schedules_follow_hf_formulas() {
        let lin = LrSchedule::new(LrSchedulerType::Linear, 1.0, 2, 10).unwrap();
        let got: Vec<f64> = [0, 1, 2, 3, 6, 10, 11].iter().map(|&s| lin.lr(s)).collect();
        assert_eq!(got, vec![0.0, 0.5, 1.0, 7.0 / 8.0, 0.5, 0.0, 0.0]);
        let cos = LrSchedule::new(LrSchedulerType::Cosine, 2.0, 2, 10).unwrap();
        assert_eq!(cos.lr(1), 1.0);
        assert_eq!(cos.lr(2), 2.0);
        assert!((cos.lr(6) - 1.0).abs() < 1e-12);
        assert!((cos.lr(4) - (1.0 + (std::f64::consts::PI * 0.25).cos())).abs() < 1e-12);
        assert!(cos.lr(10).abs() < 1e-12);
        let cst = LrSchedule::new(LrSchedulerType::Constant, 1e-6, 4, 100).unwrap();
        assert_eq!(cst.lr(1), 0.25e-6);
        assert_eq!(cst.lr(4), 1e-6);
        assert_eq!(cst.lr(99), 1e-6);
        let plain = LrSchedule::new(LrSchedulerType::Constant, 1e-6, 0, 100).unwrap();
        assert_eq!(plain.lr(0), 1e-6);
        let lin0 = LrSchedule::new(LrSchedulerType::Linear, 1.0, 0, 4).unwrap();
        assert_eq!(lin0.lr(0), 1.0);
        assert_eq!(lin0.lr(1), 0.75);
        assert!(LrSchedule::new(LrSchedulerType::Linear, 1.0, 0, 0).is_err());
        let c = GspoConfig {
            warmup_ratio: 0.05,
            ..GspoConfig::default()
        };
        let s = LrSchedule::from_config(&c, 500).unwrap();
        assert_eq!(
            (s.warmup_steps, s.total_steps, s.kind),
            (25, 500, LrSchedulerType::Linear)
        );
    }
}
