//! Key/value cache: one preallocated buffer per layer, filled in place — contiguous per row
//! (`[batch, kv_heads, capacity, head_dim]`, the lock-step batch) or paged (`[num_blocks,
//! kv_heads, block_size, head_dim]`, slots given out by [`crate::kv_blocks::BlockPool`]).

use candle_core::Tensor;

use crate::error::Result;

/// Keys and values of one layer, `[batch, kv_heads, capacity, head_dim]`, allocated on the
/// layer's device at the first append.
#[derive(Default)]
pub struct LayerCache {
    buffers: Option<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
    /// Keeps nothing: `append` hands back the keys and values it is given (a training pass,
    /// which attends within one call and must keep the graph, not write into a buffer).
    passthrough: bool,
    /// Paged keys and values, `[num_blocks, kv_heads, block_size, head_dim]` each: written at
    /// the slots a paged call names, read by block tables.
    paged: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    /// A cache that keeps nothing (see the `passthrough` field).
    pub fn passthrough() -> Self {
        LayerCache {
            passthrough: true,
            ..LayerCache::default()
        }
    }

    /// Whether this is a training pass's cache (see [`LayerCache::passthrough`]).
    pub fn is_passthrough(&self) -> bool {
        self.passthrough
    }

    /// The paged buffers (keys, values); an error for a cache that is not paged.
    pub fn paged(&self) -> Result<&(Tensor, Tensor)> {
        self.paged.as_ref().ok_or_else(|| {
            crate::ModelError::BadInput("a paged call needs a paged KV cache".into())
        })
    }

    /// Writes `k`, `v` (`[batch, kv_heads, new, head_dim]`) after the cached tokens and returns
    /// views of everything cached so far.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.passthrough {
            return Ok((k.clone(), v.clone()));
        }
        if self.paged.is_some() {
            return Err(crate::ModelError::BadInput(
                "a paged KV cache is written by paged calls (slots), not appended to".into(),
            ));
        }
        let (b, h, n, d) = k.dims4()?;
        if self.buffers.is_none() {
            let shape = (b, h, self.capacity, d);
            self.buffers = Some((
                Tensor::zeros(shape, k.dtype(), k.device())?,
                Tensor::zeros(shape, v.dtype(), v.device())?,
            ));
        }
        let (kb, vb) = self.buffers.as_ref().expect("allocated above");
        kb.slice_set(k, 2, self.len)?;
        vb.slice_set(v, 2, self.len)?;
        let total = self.len + n;
        self.len = total;
        Ok((kb.narrow(2, 0, total)?, vb.narrow(2, 0, total)?))
    }

    /// Keeps only the given rows (finished requests leave the batch).
    fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        if let Some((k, v)) = &self.buffers {
            self.buffers = Some((k.index_select(rows, 0)?, v.index_select(rows, 0)?));
        }
        Ok(())
    }
}

/// The cache of every layer of a model for one batch.
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Room for `capacity` tokens per row in each of `num_layers` layers (the batch size is
    /// taken from the first keys appended).
    pub fn new(num_layers: usize, capacity: usize) -> Self {
        KvCache {
            layers: (0..num_layers)
                .map(|_| LayerCache {
                    capacity,
                    ..LayerCache::default()
                })
                .collect(),
            len: 0,
            capacity,
        }
    }

    /// A paged cache over the given per-layer buffers (keys, values), each `[num_blocks,
    /// kv_heads, block_size, head_dim]` on its layer's device. Its length stays 0: a paged
    /// cache's lengths are its sequences' (see [`crate::kv_blocks`]).
    pub fn paged(buffers: Vec<(Tensor, Tensor)>) -> Self {
        KvCache {
            layers: buffers
                .into_iter()
                .map(|kv| LayerCache {
                    paged: Some(kv),
                    ..LayerCache::default()
                })
                .collect(),
            len: 0,
            capacity: 0,
        }
    }

    /// Whether the cache is paged.
    pub fn is_paged(&self) -> bool {
        self.layers.first().is_some_and(|l| l.paged.is_some())
    }

    /// Tokens cached per row (padding included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens per row the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn layer_mut(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Keeps only `rows` (indices into the current batch), in that order. Each layer's buffer
    /// is gathered on its own device.
    pub fn retain_rows(&mut self, rows: &[u32]) -> Result<()> {
        for layer in &mut self.layers {
            if let Some((k, _)) = &layer.buffers {
                let idx = Tensor::from_slice(rows, rows.len(), k.device())?;
                layer.select_rows(&idx)?;
            }
        }
        Ok(())
    }
}
