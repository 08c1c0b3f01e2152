//! The decoder on a paged KV cache: a prefill of one sequence (its tokens after the prefix the
//! cache already holds) and a decode step of any set of sequences, each at its own length —
//! the calls continuous batching and shared-prefix reuse are made of (see
//! [`crate::kv_blocks`] for the blocks, [`crate::generation`] for the loop).

use candle_core::{DType, Device, Module, Tensor};

use fleet_topology::{DeviceLocation, DeviceMap};

use super::{
    run_layers, DeviceInputs, LayerInputs, PagedCall, PagedCallRead, PagedInputs, PagedRead, Plain,
    Positions, QwenModel, RowPadding, Stream,
};
use crate::error::{ModelError, Result};
use crate::kv_blocks::SequenceBlocks;
use crate::kv_cache::KvCache;

impl QwenModel {
    /// An empty paged cache of `num_blocks` blocks of `block_size` slots in every layer, on
    /// the layer's device, in the model dtype.
    pub fn new_paged_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        let (kvh, d) = (self.cfg.num_kv_heads(), self.cfg.head_dim());
        let buffers = self
            .layers
            .iter()
            .map(|layer| {
                let dev = self.devices.get(layer.location);
                let shape = (num_blocks, kvh, block_size, d);
                Ok((
                    Tensor::zeros(shape, self.dtype, dev)?,
                    Tensor::zeros(shape, self.dtype, dev)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache::paged(buffers))
    }

    /// Copies block `from` to block `to` in every layer, keys and values (a forked sequence's
    /// own copy of the partial block it continues from).
    pub fn copy_paged_block(&self, cache: &mut KvCache, from: u32, to: u32) -> Result<()> {
        for i in 0..self.layers.len() {
            let (k, v) = cache.layer_mut(i).paged()?.clone();
            for c in [k, v] {
                let bs = c.dim(2)?;
                let dev = c.device();
                let block = c
                    .index_select(&Tensor::new(&[from], dev)?, 0)?
                    .squeeze(0)?
                    .transpose(0, 1)?; // [block_size, kv_heads, head_dim]
                let slots: Vec<u32> = (0..bs as u32).map(|o| to * bs as u32 + o).collect();
                crate::ops::paged_kv_write(&c, &block, &Tensor::new(slots.as_slice(), dev)?)?;
            }
        }
        Ok(())
    }

    /// Bytes of one block in every layer (keys and values): what a KV budget divides by.
    pub fn paged_block_bytes(&self, block_size: usize) -> u64 {
        2 * self.layers.len() as u64
            * (self.cfg.num_kv_heads() * self.cfg.head_dim() * block_size) as u64
            * self.dtype.size_in_bytes() as u64
    }

    /// Runs `seq`'s tokens after its cached prefix (`seq.cached..seq.len()`), writing their
    /// keys and values at their slots, and returns the last token's logits `[1, 1, vocab]`
    /// (f32). The sequence's blocks must cover its tokens.
    pub fn prefill_paged(&self, seq: &SequenceBlocks, cache: &mut KvCache) -> Result<Tensor> {
        self.prefill_paged_batch(&[seq], cache)
    }

    /// [`QwenModel::prefill_paged`] of several sequences in one pass: each row is the last
    /// `window` tokens of its sequence (`window` = the longest uncached part; a shorter row's
    /// window starts with cached tokens, or pads, which write nothing), its keys and values
    /// left-padded to the longest sequence. Returns each row's last logits `[rows, 1, vocab]`.
    pub fn prefill_paged_batch(
        &self,
        seqs: &[&SequenceBlocks],
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let bs = paged_block_size(cache)?;
        if let Some(s) = seqs.iter().find(|s| s.cached >= s.len()) {
            return Err(ModelError::BadInput(format!(
                "a paged prefill needs a token to compute: {} tokens, {} cached",
                s.len(),
                s.cached
            )));
        }
        let PrefillLayout {
            window,
            pad,
            positions,
            call,
        } = paged_prefill_layout(seqs, bs, self.cfg.num_kv_heads());
        let ids: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| {
                (0..window)
                    .map(|k| {
                        let t = s.len() as isize - window as isize + k as isize;
                        if t < 0 {
                            s.tokens[0]
                        } else {
                            s.tokens[t as usize]
                        }
                    })
                    .collect()
            })
            .collect();
        self.check_ids(&ids)?;
        let positions = Positions::PerRow {
            ids: positions,
            batch: seqs.len(),
            len: window,
        };
        let x = self.embed_ids(&ids)?;
        self.forward_embeds(x, &pad, positions, cache, true, None, Some(&call))
    }

    /// One decode step of `seqs`: each sequence's last token (its slot given, its keys and
    /// values not yet written) at position `len - 1 + shifts[r]` (Qwen3-VL's `rope_delta`;
    /// `shifts` empty: none), attending to its whole sequence. Returns logits
    /// `[seqs, 1, vocab]` (f32).
    pub fn decode_paged(
        &self,
        seqs: &[&SequenceBlocks],
        shifts: &[i64],
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.decode_paged_ahead(seqs, shifts, 0, None, true, cache)
    }

    /// [`QwenModel::decode_paged`] `ahead` tokens past each sequence's last recorded token:
    /// the step whose input is the token drawn `ahead` steps ago, still on the device as
    /// `ids` (`[seqs, 1]` u32; `None` with `ahead` 0: each sequence's last token). Each
    /// sequence's blocks must already hold the slot of its position `len - 1 + ahead` (they
    /// are taken for all of `max_new_tokens` at admission). Lets several decode steps be
    /// queued before their tokens are read back: `check_logits` false skips this step's
    /// NaN/inf check (a host read); the caller checks its last step, whose logits a bad value
    /// reaches through the cache.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_paged_ahead(
        &self,
        seqs: &[&SequenceBlocks],
        shifts: &[i64],
        ahead: usize,
        ids: Option<&Tensor>,
        check_logits: bool,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let bs = paged_block_size(cache)?;
        let max_blocks = seqs
            .iter()
            .map(|s| (s.len() + ahead).div_ceil(bs))
            .max()
            .unwrap_or(1);
        let host = self.step_inputs_ahead(seqs, shifts, ahead, bs, seqs.len(), max_blocks)?;
        let call = PagedCall {
            slots: host.slots,
            read: PagedCallRead::Decode {
                block_tables: host.tables,
                max_blocks,
                seq_lens: host.seq_lens,
            },
            check_logits,
        };
        let positions = Positions::PerRow {
            ids: host.positions,
            batch: seqs.len(),
            len: 1,
        };
        let x = match ids {
            Some(ids) => self.embed.forward(&self.ids_on_input_device(ids)?)?,
            None => {
                let ids: Vec<Vec<u32>> = host.ids.iter().map(|&t| vec![t]).collect();
                self.embed_ids(&ids)?
            }
        };
        let pad = vec![0; seqs.len()];
        self.forward_embeds(x, &pad, positions, cache, true, None, Some(&call))
    }

    /// A decode step's inputs for `seqs` in `rows` rows (the rows past them inactive), with
    /// block tables of `max_blocks`, `ahead` tokens past each sequence's last recorded one:
    /// each sequence's last token (the step's input when `ahead` is 0), its position and slot,
    /// its blocks and length.
    fn step_inputs_ahead(
        &self,
        seqs: &[&SequenceBlocks],
        shifts: &[i64],
        ahead: usize,
        bs: usize,
        rows: usize,
        max_blocks: usize,
    ) -> Result<StepInputs> {
        let n = seqs.len();
        if n == 0 || n > rows || seqs.iter().any(|s| s.is_empty()) {
            return Err(ModelError::BadInput(format!(
                "a decode step of {n} sequences in {rows} rows (at least one, each with a token)"
            )));
        }
        if !(shifts.is_empty() || shifts.len() == n) {
            return Err(ModelError::BadInput(format!(
                "a decode step of {n} sequences with {} position shifts",
                shifts.len()
            )));
        }
        let mut host = StepInputs::inactive(rows, max_blocks);
        for (r, s) in seqs.iter().enumerate() {
            let len = s.len() + ahead;
            let blocks = len.div_ceil(bs);
            if blocks > max_blocks || blocks > s.blocks.len() {
                return Err(ModelError::BadInput(format!(
                    "sequence {r} at {len} tokens needs {blocks} blocks; it holds {} and the \
                     step's tables {max_blocks}",
                    s.blocks.len()
                )));
            }
            host.ids[r] = s.tokens[s.len() - 1];
            let shift = shifts.get(r).copied().unwrap_or(0);
            host.positions[r] = u32::try_from(len as i64 - 1 + shift).map_err(|_| {
                ModelError::BadInput(format!(
                    "sequence {r}: position {} + shift {shift} is not a position",
                    len - 1
                ))
            })?;
            host.slots[r] = s.slot(len - 1, bs);
            host.seq_lens[r] = len as u32;
            host.tables[r * max_blocks..r * max_blocks + blocks]
                .copy_from_slice(&s.blocks[..blocks]);
        }
        self.check_ids(&[host.ids[..n].to_vec()])?;
        Ok(host)
    }
}

/// A decode step of up to `batch` sequences whose inputs live in device memory at fixed
/// addresses — token ids, positions, slots, block tables and lengths, a copy on every device
/// that holds layers — so that the step can be captured as CUDA graphs and replayed: one launch
/// per device segment instead of hundreds, and no host work inside the step. The host writes
/// the next step's inputs into these buffers (a few small copies) and replays; rows past the
/// live ones are inactive (length 0: attention reads nothing and yields zeros, their slot
/// `u32::MAX` writes nothing) and their logits are ignored.
///
/// A model over several devices (layer sharding, logical devices) has one segment per run of
/// layers on one device — the embedding joins the first, the head the last, each its own
/// segment where it sits on another device — and one graph per segment; between segments the
/// stream is copied through [`crate::device::transfer`] into the next segment's input buffers,
/// outside the graphs. On the CPU, or where capture is not possible (a shape the paged kernel
/// does not take, a capture that failed: reported once, not retried), the same buffers drive
/// the plain step: the same kernels in the same order, so the tokens are the same with and
/// without the graphs.
pub struct DecodeGraph {
    batch: usize,
    max_blocks: usize,
    /// `[batch, 1]` u32 on the embedding's device: each row's last token.
    ids: Tensor,
    /// The step's inputs on each device that holds layers.
    inputs: Vec<StepBuffers>,
    segments: Vec<Segment>,
    /// `[batch, 1, vocab]` in the model's dtype on the head's device, written by each step
    /// (the sampler reads bf16/f16 logits as they are: no cast kernel in the step).
    logits: Tensor,
}

/// A decode step's inputs on one device ([`DecodeGraph`]).
struct StepBuffers {
    location: DeviceLocation,
    /// `[batch]` u32: each row's position (its length - 1).
    positions: Tensor,
    /// `[batch]` u32: where each row's new keys and values go.
    slots: Tensor,
    /// `[batch, max_blocks]` u32.
    tables: Tensor,
    /// `[batch]` u32: each row's length, the current token included (0: inactive).
    seq_lens: Tensor,
    /// `[batch]` u32 zeros: paged rows have no left padding.
    pad: Tensor,
}

/// The layers a [`DecodeGraph`] runs on one device, with the stream's buffers at its ends.
struct Segment {
    location: DeviceLocation,
    device: Device,
    layers: std::ops::Range<usize>,
    /// Whether it starts with the embedding (the first) and ends with the head (the last).
    embed: bool,
    head: bool,
    /// The stream entering it (`x`, and the last layer's pending MLP output when a layer ran
    /// before), `[batch, 1, hidden]` on its device; none for the first.
    input: Option<(Tensor, Option<Tensor>)>,
    /// The stream leaving it, written by the segment; none for the last (it writes logits).
    output: Option<(Tensor, Option<Tensor>)>,
    #[cfg(feature = "cuda")]
    graph: Option<candle_core::cuda_backend::cudarc::driver::CudaGraph>,
}

impl DecodeGraph {
    /// Rows the step holds.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Device segments the step runs (one per run of layers on one device).
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// Whether the step replays captured CUDA graphs (else it runs op by op).
    pub fn is_captured(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.segments.iter().all(|s| s.graph.is_some());
        #[cfg(not(feature = "cuda"))]
        false
    }
}

/// Set once a decode step's capture failed in this process: later buckets run op by op
/// without trying again (the failure is reported once).
#[cfg(feature = "cuda")]
static CAPTURE_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Dropping the graphs hands their memory back: a graph's own allocations stay in the
/// driver's graph memory pool after the graph is destroyed until the pool is trimmed, and what
/// runs after generation (GSPO's update) must find that memory free.
#[cfg(feature = "cuda")]
impl Drop for DecodeGraph {
    fn drop(&mut self) {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let mut devices = Vec::new();
        for s in &mut self.segments {
            if let (Some(graph), Device::Cuda(cuda)) = (s.graph.take(), &s.device) {
                drop(graph);
                devices.push(cuda.cuda_stream().context().cu_device());
            }
        }
        devices.dedup();
        for d in devices {
            // SAFETY: frees only graph-pool blocks that no executing or scheduled graph
            // uses; an error leaves the memory cached, which costs nothing but memory.
            let _ = unsafe { sys::cuDeviceGraphMemTrim(d) };
        }
    }
}

impl QwenModel {
    /// Whether a decode step of this model can be captured as CUDA graphs: every device it
    /// uses is a CUDA device, and the attention shape is one the paged kernel takes. A model
    /// over several devices gets one graph per device segment (its GPU test,
    /// `decode_graph_segments`, passed on two logical devices of an H100 on 2026-11-27;
    /// `FLEET_SEGMENT_GRAPHS=0` in the environment keeps such a model op by op).
    pub fn decode_graph_supported(&self, block_size: usize) -> bool {
        static SEGMENTS: crate::ops::EnvSwitch =
            crate::ops::EnvSwitch::new("FLEET_SEGMENT_GRAPHS", true);
        let segments = SEGMENTS.on();
        let cuda = self.input_device().is_cuda()
            && self.output_device().is_cuda()
            && self
                .layers
                .iter()
                .all(|l| self.devices.get(l.location).is_cuda());
        let one_device = decode_segments(&self.map).len() == 1;
        cuda && (one_device || segments)
            && crate::ops::paged_decode_supported(
                self.cfg.head_dim(),
                self.cfg.num_attention_heads / self.cfg.num_kv_heads().max(1),
                block_size,
            )
    }

    /// The fixed-address buffers of a decode step of up to `batch` rows with block tables of
    /// `max_blocks`, on the model's devices, each segment captured as a CUDA graph when
    /// `capture` and [`QwenModel::decode_graph_supported`] (after a plain warm-up step, which
    /// loads the kernels and lets cuBLAS take its workspace). Writes nothing into the cache
    /// (every row inactive).
    pub fn decode_graph(
        &self,
        batch: usize,
        max_blocks: usize,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<DecodeGraph> {
        let bs = paged_block_size(cache)?;
        let hidden = self.cfg.hidden_size;
        let inputs = self
            .rope
            .iter()
            .map(|(loc, _)| {
                let dev = self.devices.get(*loc);
                let u32s = |v: u32| Tensor::full(v, batch, dev);
                Ok(StepBuffers {
                    location: *loc,
                    positions: u32s(0)?,
                    slots: u32s(u32::MAX)?,
                    tables: Tensor::zeros((batch, max_blocks), DType::U32, dev)?,
                    seq_lens: u32s(0)?,
                    pad: u32s(0)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let runs = decode_segments(&self.map);
        let last = runs.len() - 1;
        let stream = |dev: &Device, pending: bool| -> Result<(Tensor, Option<Tensor>)> {
            let t = || Tensor::zeros((batch, 1, hidden), self.dtype, dev);
            Ok((t()?, if pending { Some(t()?) } else { None }))
        };
        let mut segments = Vec::with_capacity(runs.len());
        for (k, (loc, layers)) in runs.into_iter().enumerate() {
            let device = self.devices.get(loc).clone();
            // A stream has a pending MLP output once a layer ran before it.
            let input = match k {
                0 => None,
                _ => Some(stream(&device, layers.start > 0)?),
            };
            let output = match k == last {
                true => None,
                false => Some(stream(&device, layers.end > 0)?),
            };
            segments.push(Segment {
                location: loc,
                device,
                layers,
                embed: k == 0,
                head: k == last,
                input,
                output,
                #[cfg(feature = "cuda")]
                graph: None,
            });
        }
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut graph = DecodeGraph {
            batch,
            max_blocks,
            ids: Tensor::zeros((batch, 1), DType::U32, self.input_device())?,
            inputs,
            segments,
            logits: Tensor::zeros(
                (batch, 1, self.cfg.vocab_size),
                self.lm_head.weight().dtype(),
                self.output_device(),
            )?,
        };
        #[cfg(feature = "cuda")]
        let capture = capture && !CAPTURE_FAILED.load(std::sync::atomic::Ordering::Relaxed);
        if capture && self.decode_graph_supported(bs) {
            #[cfg(feature = "cuda")]
            {
                // candle uploads some kernels' shapes and strides from the host; a captured
                // copy would read that host memory again at every replay, long after it was
                // freed. With candle's capture cache on (a per-thread switch), the warm-up
                // steps keep those uploads on the device and the capture reuses them (it
                // fails on any it has not seen).
                let Device::Cuda(cuda) = self.input_device() else {
                    unreachable!("decode_graph_supported checks the devices")
                };
                let _uploads = cuda.enable_cuda_graph_htod_cache();
                // One plain step of these shapes loads the kernels, lets cuBLAS take the
                // workspace they need and fills the upload cache (a GSPO generation batch
                // captures each bucket its draining rows pass through: every step saved counts).
                for k in 0..graph.segments.len() {
                    self.run_segment(&mut graph, k, cache)?;
                }
                for s in &graph.segments {
                    s.device.synchronize()?;
                }
                for k in 0..graph.segments.len() {
                    match self.capture_segment(&graph, k, cache) {
                        Ok(g) => graph.segments[k].graph = Some(g),
                        Err(e) => {
                            // The step still runs from the same buffers, op by op: slower,
                            // the same tokens. Said once, loudly; later buckets do not retry.
                            CAPTURE_FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
                            tracing::warn!(
                                "capturing the decode step as a CUDA graph failed ({e}); \
                                 decoding op by op from now on (FLEET_ENFORCE_EAGER=1 skips \
                                 the attempt)"
                            );
                            for s in &mut graph.segments {
                                s.graph = None;
                            }
                            break;
                        }
                    }
                }
            }
        }
        Ok(graph)
    }

    /// One decode step of the live `seqs` (at most `graph.batch()`) through `graph`'s buffers:
    /// the same as [`QwenModel::decode_paged_ahead`] (`ahead` tokens past each sequence's last
    /// recorded one, the input `ids` on the device or `None` for each sequence's last token),
    /// returning logits `[seqs, 1, vocab]`: a view of the step's output buffer, valid until
    /// the next step through `graph` (a step queued after it on the stream may read it), in
    /// the model's dtype (the plain step's f32 logits are these values widened).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_paged_with(
        &self,
        graph: &mut DecodeGraph,
        seqs: &[&SequenceBlocks],
        shifts: &[i64],
        ahead: usize,
        ids: Option<&Tensor>,
        check_logits: bool,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let bs = paged_block_size(cache)?;
        let n = seqs.len();
        let host =
            self.step_inputs_ahead(seqs, shifts, ahead, bs, graph.batch, graph.max_blocks)?;
        host.write(graph, ids.is_none())?;
        if let Some(ids) = ids {
            // The tokens drawn by the step before, copied on the device into the graph's input.
            graph.ids.slice_set(&self.ids_on_input_device(ids)?, 0, 0)?;
        }
        for k in 0..graph.segments.len() {
            self.run_segment(graph, k, cache)?;
        }
        let logits = graph.logits.narrow(0, 0, n)?;
        if check_logits {
            // The step has no host reads inside: the logits are checked here, as the plain
            // step checks them.
            let vocab = self.cfg.vocab_size;
            self.check_logits(&logits, |first| {
                let row = first / vocab;
                Ok(format!(
                    "the logits of row {row} at position {}",
                    seqs[row].len() - 1 + ahead
                ))
            })?;
        }
        Ok(logits)
    }

    /// A decode step through `graph`'s buffers ([`QwenModel::decode_paged_with`]) when there
    /// is one, else the plain step ([`QwenModel::decode_paged_ahead`]): the same tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_paged_step(
        &self,
        graph: Option<&mut DecodeGraph>,
        seqs: &[&SequenceBlocks],
        shifts: &[i64],
        ahead: usize,
        ids: Option<&Tensor>,
        check_logits: bool,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        match graph {
            Some(g) => self.decode_paged_with(g, seqs, shifts, ahead, ids, check_logits, cache),
            None => self.decode_paged_ahead(seqs, shifts, ahead, ids, check_logits, cache),
        }
    }

    /// Token ids drawn on the head's device, on the embedding's, through
    /// [`crate::device::transfer`]: a copy made by the embedding device's stream must wait for
    /// the sampler on the head's. Between two logical devices of one GPU candle would take the
    /// tensor as it is (one location) and read it unordered; the next step then embedded the
    /// token before last (the GPU test `decode_graph_segments` caught it).
    fn ids_on_input_device(&self, ids: &Tensor) -> Result<Tensor> {
        crate::device::transfer(ids, self.input_device())
    }

    /// Segment `k` of the step: its input copied in from the segment before (through
    /// [`crate::device::transfer`]), then its graph replayed, or its ops run.
    fn run_segment(&self, graph: &mut DecodeGraph, k: usize, cache: &mut KvCache) -> Result<()> {
        if k > 0 {
            let (prev, rest) = graph.segments.split_at_mut(k);
            let from = prev[k - 1]
                .output
                .as_ref()
                .expect("a segment before the last");
            let to = rest[0].input.as_ref().expect("a segment after the first");
            let dev = &rest[0].device;
            to.0.slice_set(&crate::device::transfer(&from.0, dev)?, 0, 0)?;
            if let (Some(p), Some(q)) = (&from.1, &to.1) {
                q.slice_set(&crate::device::transfer(p, dev)?, 0, 0)?;
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = &graph.segments[k].graph {
            return g.launch().map_err(cuda_err);
        }
        self.segment_on(graph, k, cache)
    }

    /// Segment `k` itself, from the graph's buffers only (no host data: what a capture
    /// records): the embedding of `ids` or the input stream, its layers, then the head into
    /// `logits` or the stream into its output buffers.
    fn segment_on(&self, graph: &DecodeGraph, k: usize, cache: &mut KvCache) -> Result<()> {
        let seg = &graph.segments[k];
        let mut stream = match &seg.input {
            _ if seg.embed => Stream::new(self.embed.forward(&graph.ids)?),
            Some((x, pending)) => Stream {
                x: x.clone(),
                pending: pending.clone(),
            },
            None => unreachable!("only the first segment has no input"),
        };
        if !seg.layers.is_empty() {
            // The inputs of this segment's device only: a capture records one stream.
            let inputs = LayerInputs(
                self.rope
                    .iter()
                    .zip(&graph.inputs)
                    .filter(|((loc, _), _)| *loc == seg.location)
                    .map(|((loc, tables), b)| {
                        debug_assert_eq!(*loc, b.location);
                        Ok((
                            *loc,
                            DeviceInputs {
                                rope: tables.rows_at(&b.positions, graph.batch, 1)?,
                                pad: RowPadding {
                                    counts: b.pad.clone(),
                                    padded: true,
                                },
                                paged: Some(PagedInputs {
                                    slots: b.slots.clone(),
                                    read: PagedRead::Decode {
                                        block_tables: b.tables.clone(),
                                        seq_lens: b.seq_lens.clone(),
                                    },
                                }),
                            },
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?,
            );
            stream = run_layers(
                seg.layers.clone(),
                |i| Ok(&self.layers[i]),
                &self.devices,
                &inputs,
                Some(cache),
                &mut Plain,
                stream,
            )?;
        }
        if seg.head {
            let (_, x) = self
                .norm
                .stream_forward(&stream.x, stream.pending.as_ref())?;
            let logits = crate::ops::linear(&self.lm_head, &x)?;
            return Ok(graph.logits.slice_set(&logits, 0, 0)?);
        }
        let (x, pending) = seg.output.as_ref().expect("a segment before the last");
        x.slice_set(&stream.x, 0, 0)?;
        if let (Some(buf), Some(p)) = (pending, &stream.pending) {
            buf.slice_set(p, 0, 0)?;
        }
        Ok(())
    }

    /// Records segment `k` on its device's stream (thread-local capture: other replicas'
    /// threads keep running) into a graph that writes its output buffers (or the logits).
    /// Every tensor the segment makes is dropped inside the capture, so the graph frees what
    /// it allocates.
    #[cfg(feature = "cuda")]
    fn capture_segment(
        &self,
        graph: &DecodeGraph,
        k: usize,
        cache: &mut KvCache,
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaGraph> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let Device::Cuda(cuda) = &graph.segments[k].device else {
            return Err(ModelError::BadInput(
                "a decode graph needs CUDA devices".into(),
            ));
        };
        let stream = cuda.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err)?;
        crate::profile::set_capturing(true);
        let recorded = self.segment_on(graph, k, cache);
        crate::profile::set_capturing(false);
        // End the capture whatever happened: a stream left capturing fails every later call.
        let flags = sys::CUgraphInstantiate_flags(0);
        let ended = stream.end_capture(flags);
        if ended.is_err() {
            // cudarc returns an error an op recorded in the context earlier (a failed free in
            // the capture, say) before it ends the capture; that read cleared it, so a second
            // call ends the capture for real and the op-by-op fallback finds a usable stream.
            use sys::CUstreamCaptureStatus as Status;
            if matches!(
                stream.capture_status(),
                Ok(Status::CU_STREAM_CAPTURE_STATUS_ACTIVE
                    | Status::CU_STREAM_CAPTURE_STATUS_INVALIDATED)
            ) {
                let _ = stream.end_capture(flags);
            }
        }
        recorded?;
        let g = ended.map_err(cuda_err)?.ok_or_else(|| {
            ModelError::BadInput("the decode step's capture recorded nothing".into())
        })?;
        g.upload().map_err(cuda_err)?;
        Ok(g)
    }
}

/// A decode step's device segments under `map`: runs of layers on one device, the embedding
/// joining the first and the head the last when they share its device, else each a segment of
/// its own (no layers).
fn decode_segments(map: &DeviceMap) -> Vec<(DeviceLocation, std::ops::Range<usize>)> {
    let mut runs: Vec<(DeviceLocation, std::ops::Range<usize>)> = Vec::new();
    if map.layers.first() != Some(&map.embed) {
        runs.push((map.embed, 0..0));
    }
    for (i, &loc) in map.layers.iter().enumerate() {
        match runs.last_mut() {
            Some((at, r)) if *at == loc => r.end = i + 1,
            _ => runs.push((loc, i..i + 1)),
        }
    }
    if runs.last().map(|(loc, _)| *loc) != Some(map.head) {
        let n = map.layers.len();
        runs.push((map.head, n..n));
    }
    runs
}

/// A decode step's inputs on the host, inactive rows included.
struct StepInputs {
    ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    tables: Vec<u32>,
    seq_lens: Vec<u32>,
}

impl StepInputs {
    fn inactive(batch: usize, max_blocks: usize) -> Self {
        StepInputs {
            ids: vec![0; batch],
            positions: vec![0; batch],
            slots: vec![u32::MAX; batch],
            tables: vec![0; batch * max_blocks],
            seq_lens: vec![0; batch],
        }
    }

    /// Into the graph's buffers on every device, in place (their addresses are what the
    /// graphs read); the token ids only with `ids` (else the caller copies the drawn ones in
    /// on the device).
    fn write(&self, g: &DecodeGraph, ids: bool) -> Result<()> {
        let put = |dst: &Tensor, src: &[u32]| -> Result<()> {
            let t = Tensor::from_slice(src, dst.shape(), dst.device())?;
            Ok(dst.slice_set(&t, 0, 0)?)
        };
        if ids {
            put(&g.ids, &self.ids)?;
        }
        for b in &g.inputs {
            put(&b.positions, &self.positions)?;
            put(&b.slots, &self.slots)?;
            put(&b.tables, &self.tables)?;
            put(&b.seq_lens, &self.seq_lens)?;
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
fn cuda_err(e: candle_core::cuda_backend::cudarc::driver::DriverError) -> ModelError {
    ModelError::Candle(candle_core::Error::Msg(format!("CUDA graph: {e}")))
}

/// The block size of a paged cache (an error naming the mix-up for a contiguous one).
pub(crate) fn paged_block_size(cache: &mut KvCache) -> Result<usize> {
    let (k, _) = cache.layer_mut(0).paged()?;
    Ok(k.dim(2)?)
}

/// The layout of a batched paged prefill ([`paged_prefill_layout`]).
pub(crate) struct PrefillLayout {
    /// Tokens per row: the longest uncached part.
    pub(crate) window: usize,
    /// Each row's key padding (to the longest sequence).
    pub(crate) pad: Vec<usize>,
    /// Per window place (row-major): its position (0 for a pad).
    pub(crate) positions: Vec<u32>,
    /// The call: per window place its slot (`u32::MAX` for a pad or a cached token: nothing
    /// written), and where each row's keys and values are read from.
    pub(crate) call: PagedCall,
}

/// The layout of a batched paged prefill of `seqs`: each row the last `window` tokens of its
/// sequence, its keys left-padded to the longest sequence.
pub(crate) fn paged_prefill_layout(
    seqs: &[&SequenceBlocks],
    bs: usize,
    kv_heads: usize,
) -> PrefillLayout {
    let window = seqs.iter().map(|s| s.uncached()).max().unwrap_or(0);
    let max_len = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
    let pad = seqs.iter().map(|s| max_len - s.len()).collect();
    let mut positions = Vec::with_capacity(seqs.len() * window);
    let mut slots = Vec::with_capacity(seqs.len() * window);
    for s in seqs {
        for k in 0..window {
            let t = s.len() as isize - window as isize + k as isize;
            if t < 0 {
                positions.push(0);
                slots.push(u32::MAX);
            } else {
                let t = t as usize;
                positions.push(t as u32);
                slots.push(if t >= s.cached {
                    s.slot(t, bs)
                } else {
                    u32::MAX
                });
            }
        }
    }
    // Each row's keys (or values) left-padded to the longest, as rows of the cache viewed as
    // [blocks * kv_heads * block_size, head_dim]: one gather for the whole pass. A pad points
    // at row 0 (any finite values: the mask's key start hides them).
    let mut gather = Vec::with_capacity(seqs.len() * kv_heads * max_len);
    for s in seqs {
        let pad = max_len - s.len();
        for h in 0..kv_heads {
            gather.extend(std::iter::repeat_n(0, pad));
            gather.extend((0..s.len()).map(|t| {
                let block = s.blocks[t / bs] as usize;
                ((block * kv_heads + h) * bs + t % bs) as u32
            }));
        }
    }
    let call = PagedCall {
        slots,
        read: PagedCallRead::Prefill {
            gather,
            rows: seqs.len(),
            max_len,
        },
        check_logits: true,
    };
    PrefillLayout {
        window,
        pad,
        positions,
        call,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_segments_follow_the_device_map() {
        let (a, b) = (DeviceLocation::Cuda(0), DeviceLocation::Cuda(1));
        let map = |embed, layers: &[DeviceLocation], head| DeviceMap {
            embed,
            layers: layers.to_vec(),
            head,
        };
        // One device: one segment with the embedding, every layer and the head.
        assert_eq!(decode_segments(&map(a, &[a, a, a], a)), vec![(a, 0..3)]);
        // Split layers: the embedding joins the first run, the head the last.
        assert_eq!(
            decode_segments(&map(a, &[a, a, b], b)),
            vec![(a, 0..2), (b, 2..3)]
        );
        // The embedding and the head on a device of their own.
        assert_eq!(
            decode_segments(&map(a, &[b, b], a)),
            vec![(a, 0..0), (b, 0..2), (a, 2..2)]
        );
        // A device used twice, not contiguously: two segments on it.
        assert_eq!(
            decode_segments(&map(a, &[a, b, a], a)),
            vec![(a, 0..1), (b, 1..2), (a, 2..3)]
        );
    }
}
