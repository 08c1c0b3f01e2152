//! The decoder on a paged KV cache: a prefill of one sequence (its tokens after the prefix the
//! cache already holds) and a decode step of any set of sequences, each at its own length —
//! the calls continuous batching and shared-prefix reuse are made of (see
//! [`crate::kv_blocks`] for the blocks, [`crate::generation`] for the loop).

use candle_core::Tensor;

use super::{PagedCall, PagedCallRead, Positions, QwenModel};
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
        let bs = paged_block_size(cache)?;
        let (start, len) = (seq.cached, seq.len());
        if start >= len {
            return Err(ModelError::BadInput(format!(
                "a paged prefill needs a token to compute: {len} tokens, {start} cached"
            )));
        }
        let ids = vec![seq.tokens[start..].to_vec()];
        self.check_ids(&ids)?;
        let call = PagedCall {
            slots: (start..len).map(|i| seq.slot(i, bs)).collect(),
            read: PagedCallRead::Prefill {
                blocks: seq.blocks[..len.div_ceil(bs)].to_vec(),
                len,
            },
        };
        let positions = Positions::Shared {
            start,
            len: len - start,
        };
        let x = self.embed_ids(&ids)?;
        self.forward_embeds(x, &[0], positions, cache, true, None, Some(&call))
    }

    /// One decode step of `seqs`: each sequence's last token (its slot given, its keys and
    /// values not yet written) at position `len - 1`, attending to its whole sequence.
    /// Returns logits `[seqs, 1, vocab]` (f32).
    pub fn decode_paged(&self, seqs: &[&SequenceBlocks], cache: &mut KvCache) -> Result<Tensor> {
        let bs = paged_block_size(cache)?;
        if seqs.is_empty() || seqs.iter().any(|s| s.is_empty()) {
            return Err(ModelError::BadInput(
                "a paged decode step needs at least one sequence, each with a token".into(),
            ));
        }
        let ids: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| vec![*s.tokens.last().expect("checked above")])
            .collect();
        self.check_ids(&ids)?;
        let max_blocks = seqs.iter().map(|s| s.len().div_ceil(bs)).max().unwrap_or(1);
        let mut block_tables = Vec::with_capacity(seqs.len() * max_blocks);
        for s in seqs {
            let n = s.len().div_ceil(bs);
            block_tables.extend_from_slice(&s.blocks[..n]);
            // Past a row's length nothing is read: any block id pads the table.
            block_tables.extend(std::iter::repeat_n(s.blocks[0], max_blocks - n));
        }
        let call = PagedCall {
            slots: seqs.iter().map(|s| s.slot(s.len() - 1, bs)).collect(),
            read: PagedCallRead::Decode {
                block_tables,
                max_blocks,
                seq_lens: seqs.iter().map(|s| s.len() as u32).collect(),
            },
        };
        let positions = Positions::PerRow {
            ids: seqs.iter().map(|s| (s.len() - 1) as u32).collect(),
            batch: seqs.len(),
            len: 1,
        };
        let x = self.embed_ids(&ids)?;
        let pad = vec![0; seqs.len()];
        self.forward_embeds(x, &pad, positions, cache, true, None, Some(&call))
    }
}

/// The block size of a paged cache (an error naming the mix-up for a contiguous one).
fn paged_block_size(cache: &mut KvCache) -> Result<usize> {
    let (k, _) = cache
        .layer_mut(0)
        .paged()
        .ok_or_else(|| ModelError::BadInput("a paged call needs a paged KV cache".into()))?;
    Ok(k.dim(2)?)
}
