//! The sharded optimizer state: a rank's own part of a state dict, and the whole state gathered
//! on one rank (PyTorch's `consolidate_state_dict`).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use module_core::DistributedError;
use module_state::StateDict;

use super::ZeroRedundancyOptimizer;
use crate::error::{Error, Result, StateError};
use crate::optimizer::Optimizer;

/// The rank a sharded state dict was saved on.
pub(super) const RANK_KEY: &str = "zero.rank";
/// The world size it was saved with.
pub(super) const WORLD_KEY: &str = "zero.world_size";

/// The parameter path and state name of a `state.<path>.<name>` key.
fn state_key(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix("state.")?.rsplit_once('.')
}

impl<O: Optimizer> ZeroRedundancyOptimizer<'_, O> {
    /// `state` without the `zero.*` keys and without the state of the parameters other ranks
    /// own: what the inner optimizer loads on this rank. A shard saved on another rank or with
    /// another world size is [`Error::ZeroMismatch`].
    pub(super) fn own_shard(&self, state: &StateDict) -> Result<StateDict> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let read = |key: &str| -> Result<Option<f64>> {
            match state.get(key) {
                None => Ok(None),
                Some(t) => Ok(Some(crate::state::scalar(t, key)?)),
            }
        };
        let (saved_rank, saved_world) = (read(RANK_KEY)?, read(WORLD_KEY)?);
        if saved_rank.is_some() != saved_world.is_some() {
            let missing = if saved_rank.is_none() {
                RANK_KEY
            } else {
                WORLD_KEY
            };
            return Err(StateError::MissingKeys {
                keys: vec![missing.to_owned()],
            }
            .into());
        }
        if let (Some(r), Some(w)) = (saved_rank, saved_world) {
            if r != rank as f64 || w != world as f64 {
                return Err(Error::ZeroMismatch {
                    rank,
                    reason: format!(
                        "the sharded optimizer state of rank {r} of {w} cannot be loaded on rank \
                         {rank} of {world}: load each rank's own shard, or a consolidated state \
                         dict (`consolidate_state_dict`)"
                    ),
                });
            }
        }
        let owner: HashMap<&str, usize> = self
            .params
            .iter()
            .zip(&self.owner)
            .map(|((path, _, _), &o)| (path.as_str(), o))
            .collect();
        let mut shard = StateDict::new();
        for (key, t) in state.iter() {
            if key == RANK_KEY || key == WORLD_KEY {
                continue;
            }
            let foreign = state_key(key)
                .and_then(|(path, _)| owner.get(path))
                .is_some_and(|&o| o != rank);
            if !foreign {
                shard.insert(key, t.clone());
            }
        }
        Ok(shard)
    }

    /// Gathers the whole optimizer state on rank `to` (PyTorch's
    /// `ZeroRedundancyOptimizer.consolidate_state_dict(to)`): `Some` state dict there, `None` on
    /// the other ranks. Every rank must call it.
    ///
    /// The result is the state dict the inner optimizer has in a single process that ran the same
    /// steps: `state.<path>.<name>` of every stepped parameter (parameter by parameter, in the
    /// optimizer's order), `param_groups.<g>.<name>` and `params.<path>`, which
    /// [`load_state_dict`](Optimizer::load_state_dict) of a single-process optimizer takes, and
    /// [`save_state`](Optimizer::save_state) writes (`torch.save(optim.state_dict())`). Each rank
    /// broadcasts its entries in turn (a name, a dtype and a shape, then the values), so a rank
    /// holds one other rank's tensor at a time beyond its own state.
    pub fn consolidate_state_dict(&self, to: usize) -> Result<Option<StateDict>> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        if to >= world {
            return Err(Error::Runtime(
                DistributedError::InvalidRank {
                    rank: to,
                    world_size: world,
                }
                .into(),
            ));
        }
        let local = self.optim.state_dict()?;
        let mut received: HashMap<String, Tensor> = HashMap::new();
        for sender in 0..world {
            let entries: Vec<(&str, &Tensor)> = if sender == rank {
                local
                    .iter()
                    .filter(|(k, _)| state_key(k).is_some())
                    .collect()
            } else {
                Vec::new()
            };
            let count = self.broadcast_u32(entries.len() as u32, sender)?;
            for e in 0..count as usize {
                let (key, value) = match entries.get(e) {
                    Some((key, value)) => (Some(*key), Some(*value)),
                    None => (None, None),
                };
                let (key, value) = self.broadcast_entry(key, value, sender)?;
                if rank == to {
                    received.insert(key, value);
                }
            }
        }
        if rank != to {
            return Ok(None);
        }
        let mut full = StateDict::new();
        for (path, _, _) in &self.params {
            let mut own: Vec<(&String, &Tensor)> = received
                .iter()
                .filter(|(k, _)| state_key(k).is_some_and(|(p, _)| p == path))
                .collect();
            // The inner optimizer's order of names (`step`, `exp_avg`, …), as the sender had it.
            let position = |k: &str| local.keys().position(|l| l == k).unwrap_or(usize::MAX);
            own.sort_by_key(|(k, _)| (position(k), (*k).clone()));
            for (k, t) in own {
                full.insert(k.clone(), t.clone());
            }
        }
        for (key, t) in local.iter() {
            if state_key(key).is_none() {
                full.insert(key, t.clone());
            }
        }
        Ok(Some(full))
    }

    /// `value` on `root`, to every rank.
    fn broadcast_u32(&self, value: u32, root: usize) -> Result<u32> {
        let t = Tensor::new(&[value], &self.comm.device())?;
        self.comm.broadcast(&t, root)?;
        Ok(t.to_vec1::<u32>()?[0])
    }

    /// One state entry of `root` (`key` and `value` there, `None` elsewhere), to every rank.
    fn broadcast_entry(
        &self,
        key: Option<&str>,
        value: Option<&Tensor>,
        root: usize,
    ) -> Result<(String, Tensor)> {
        let device = self.comm.device();
        let header = match (key, value) {
            (Some(k), Some(v)) => {
                let dims: Vec<String> = v.dims().iter().map(usize::to_string).collect();
                format!("{k}\n{}\n{}", v.dtype().as_str(), dims.join(","))
            }
            _ => String::new(),
        };
        let len = self.broadcast_u32(header.len() as u32, root)? as usize;
        let bytes = match key {
            Some(_) => Tensor::new(header.as_bytes(), &device)?,
            None => Tensor::zeros(len, DType::U8, &device)?,
        };
        self.comm.broadcast(&bytes, root)?;
        let header = String::from_utf8(bytes.to_vec1::<u8>()?).map_err(|e| bad_header(&e))?;
        let mut parts = header.split('\n');
        let (Some(k), Some(dtype), Some(dims), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad_header(&header));
        };
        let dtype: DType = dtype.parse().map_err(|_| bad_header(&header))?;
        let dims = dims
            .split(',')
            .filter(|d| !d.is_empty())
            .map(|d| d.parse::<usize>().map_err(|_| bad_header(&header)))
            .collect::<Result<Vec<_>>>()?;
        let data = match value {
            Some(v) => v.flatten_all()?.to_device(&device)?.copy()?,
            None => Tensor::zeros(dims.iter().product::<usize>(), dtype, &device)?,
        };
        self.comm.broadcast(&data, root)?;
        let value = data.reshape(dims)?.to_device(&Device::Cpu)?;
        Ok((k.to_owned(), value))
    }
}

/// A header that did not survive the transfer (an engine fault).
fn bad_header(what: &dyn std::fmt::Display) -> Error {
    Error::Runtime(
        DistributedError::Backend {
            backend: "consolidate_state_dict",
            message: format!("a state entry's header arrived garbled: {what}"),
        }
        .into(),
    )
}
