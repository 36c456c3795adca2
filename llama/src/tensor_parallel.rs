//! The decoder split over the ranks of a tensor-parallel group (PyTorch's Llama plan for
//! `parallelize_module`, Megatron's split): each rank keeps its query heads — `q_proj` by rows,
//! `o_proj` by columns, its output summed over the ranks — and its key/value heads (split as
//! well, or, with fewer key/value heads than ranks, the one its query heads read), and its part
//! of the feed-forward block (`gate_proj`/`up_proj` by rows, `down_proj` by columns, summed). The
//! embedding, the norms and the head stay whole on every rank, so every rank computes the same
//! logits and picks the same tokens.

use std::ops::Range;
use std::sync::Arc;

use module_runtime::nn::{even_shard, Linear, TensorParallel};
use module_runtime::prelude::*;

use crate::config::invalid;
use crate::LlamaForCausalLM;

impl LlamaForCausalLM {
    /// Keeps this rank's part of every decoder layer (see the module's docs): inference with
    /// `generate`, `prefill` and `step` runs as before, each layer's two all-reduces combining the
    /// ranks' parts; the cache holds this rank's key/value heads. The query heads must split
    /// evenly over the ranks, and the key/value heads too — or the ranks over them (multi-query
    /// attention on any number of ranks). All or nothing: an error leaves the model whole.
    ///
    /// Run every rank's model in step (each call of one is a call of all), without gradients.
    /// Ranks as threads of one process (`LocalGroup`): let every rank finish loading (a
    /// `barrier`) before the first call — a load waits for the calls in flight, and a call waits
    /// at its all-reduce for every rank.
    pub fn tensor_parallel(&mut self, mesh: &TensorParallel) -> Result<()> {
        let (rank, world) = (mesh.rank, mesh.world_size);
        let cfg = &self.config;
        let d = cfg.head_dim;
        let heads = even_shard("num_attention_heads", cfg.num_attention_heads, rank, world)?;
        let kv = cfg.num_key_value_heads;
        let kv_heads: Range<usize> = if kv >= world {
            even_shard("num_key_value_heads", kv, rank, world)?
        } else if world.is_multiple_of(kv) {
            // Fewer key/value heads than ranks: the head this rank's query heads read.
            let h = rank / (world / kv);
            h..h + 1
        } else {
            return Err(invalid(format!(
                "{kv} key/value heads over {world} ranks: neither divides the other"
            )));
        };
        let inter = even_shard("intermediate_size", cfg.intermediate_size, rank, world)?;
        let rows = |r: &Range<usize>| r.start * d..r.end * d;
        // Shard copies of every layer's projections first; commit only if all succeed.
        let mut staged = Vec::with_capacity(self.model.layers.len());
        for layer in &self.model.layers {
            let (attn, mlp) = (&layer.self_attn, &layer.mlp);
            let by_rows = |l: &Linear, r: Range<usize>| -> Result<Linear> {
                let mut l = l.clone();
                l.shard_rows(r)?;
                Ok(l)
            };
            let by_cols = |l: &Linear, c: Range<usize>| -> Result<Linear> {
                let mut l = l.clone();
                l.shard_cols(c, rank == 0, mesh.reduce.clone())?;
                Ok(l)
            };
            staged.push([
                by_rows(&attn.q_proj, rows(&heads))?,
                by_rows(&attn.k_proj, rows(&kv_heads))?,
                by_rows(&attn.v_proj, rows(&kv_heads))?,
                by_cols(&attn.o_proj, rows(&heads))?,
                by_rows(&mlp.gate_proj, inter.clone())?,
                by_rows(&mlp.up_proj, inter.clone())?,
                by_cols(&mlp.down_proj, inter.clone())?,
            ]);
        }
        let layers: Option<Vec<_>> = self.model.layers.iter_mut().map(Arc::get_mut).collect();
        let layers = layers.ok_or_else(|| {
            invalid("a decoder layer is shared (an `Arc` held elsewhere): cannot split it".into())
        })?;
        for (layer, [q, k, v, o, gate, up, down]) in layers.into_iter().zip(staged) {
            let attn = &mut layer.self_attn;
            (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) = (q, k, v, o);
            attn.num_heads = heads.len();
            attn.num_key_value_heads = kv_heads.len();
            let mlp = &mut layer.mlp;
            (mlp.gate_proj, mlp.up_proj, mlp.down_proj) = (gate, up, down);
        }
        Ok(())
    }
}
