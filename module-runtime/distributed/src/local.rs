//! [`LocalGroup`]: a process group whose ranks are threads of one process.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::collective::{
    check_contiguous, check_gather, check_peer, check_received, check_root, write_into,
};
use super::{Collective, DistributedError, ReduceOp};
use crate::Result;

/// What one rank asked for, to check that all ranks asked for the same thing.
#[derive(Debug, Clone, PartialEq)]
enum Op {
    AllReduce(ReduceOp),
    Broadcast(usize),
    Barrier,
    AllGather,
    ReduceScatter(ReduceOp),
}

#[derive(Default)]
struct State {
    /// Completed collectives; a rank waits for this to move past the value it saw on arrival.
    generation: u64,
    /// Each rank's contribution to the collective in progress.
    slots: Vec<Option<(Op, Option<Tensor>)>>,
    arrived: usize,
    /// The result of the last completed collective (valid until every rank has read it, which
    /// is before the next one can complete).
    result: Option<std::result::Result<Option<Tensor>, DistributedError>>,
    /// Set by a timeout: every later call fails.
    poisoned: Option<String>,
}

struct Shared {
    world_size: usize,
    timeout: Option<Duration>,
    state: Mutex<State>,
    arrived: Condvar,
    mail: Mutex<Mailbox>,
    delivered: Condvar,
}

/// The point-to-point messages in flight, by `(src, dst)`.
#[derive(Default)]
struct Mailbox {
    /// Messages sent and not yet received, oldest first, with their sequence numbers.
    queues: HashMap<(usize, usize), VecDeque<(u64, Tensor)>>,
    /// Messages sent so far (the next sequence number).
    sent: HashMap<(usize, usize), u64>,
    /// Messages received so far: a sender waits until this passes its sequence number.
    taken: HashMap<(usize, usize), u64>,
}

/// A process group whose ranks are threads of one process, through shared memory: data-parallel
/// code can be run and tested with several ranks without MPI or a GPU.
///
/// [`LocalGroup::new`] returns one handle per rank; move each into its own thread.
/// Point-to-point [`send`](Collective::send) is synchronous (MPI's `MPI_Ssend`): it returns once
/// the peer's [`recv`](Collective::recv) has taken the message, so an order of sends and
/// receives that completes here completes on every engine. Sums are
/// computed in rank order (0 + 1 + …), so every rank gets bitwise the same result. Calls are
/// checked: ranks that call different collectives, or pass tensors of different shapes or
/// dtypes, all get [`DistributedError::OpMismatch`] instead of corrupt data. With
/// [`with_timeout`](Self::with_timeout), a collective that some rank never joins fails with
/// [`DistributedError::Timeout`] and makes the group unusable.
///
/// ```
/// use module_runtime::distributed::{Collective, LocalGroup, ReduceOp};
/// use module_runtime::prelude::*;
///
/// let ranks = LocalGroup::new(2)?;
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let handles: Vec<_> = ranks
///         .into_iter()
///         .map(|comm| {
///             s.spawn(move || -> Result<Vec<f32>> {
///                 let t = Tensor::new(&[comm.rank() as f32, 1.0], &Device::Cpu)?;
///                 comm.all_reduce(&t, ReduceOp::Sum)?;
///                 Ok(t.to_vec1()?)
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<_>>()
/// })?;
/// assert_eq!(sums, [[1.0, 2.0], [1.0, 2.0]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl LocalGroup {
    /// A group of `world_size` ranks with no timeout: one handle per rank, rank `i` at index `i`.
    pub fn new(world_size: usize) -> Result<Vec<LocalGroup>> {
        Self::build(world_size, None)
    }

    /// A group of `world_size` ranks whose collectives fail after waiting `timeout` for the
    /// other ranks.
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Result<Vec<LocalGroup>> {
        Self::build(world_size, Some(timeout))
    }

    fn build(world_size: usize, timeout: Option<Duration>) -> Result<Vec<LocalGroup>> {
        if world_size == 0 {
            return Err(DistributedError::InvalidRank {
                rank: 0,
                world_size,
            }
            .into());
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                slots: vec![None; world_size],
                ..State::default()
            }),
            arrived: Condvar::new(),
            mail: Mutex::new(Mailbox::default()),
            delivered: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left consistent state (every update is
        // completed before anything can panic), so go on.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Deposits this rank's part and waits for the combined result.
    fn run(&self, op: Op, name: &'static str, data: Option<Tensor>) -> Result<Option<Tensor>> {
        let world = self.shared.world_size;
        let mut state = self.lock();
        if let Some(reason) = &state.poisoned {
            return Err(DistributedError::Poisoned {
                reason: reason.clone(),
            }
            .into());
        }
        state.slots[self.rank] = Some((op, data));
        state.arrived += 1;
        if state.arrived == world {
            let parts: Vec<_> = state.slots.iter_mut().map(|s| s.take()).collect();
            let result = combine(parts.into_iter().flatten().collect(), world);
            let mine = result.clone();
            state.result = Some(result);
            state.arrived = 0;
            state.generation += 1;
            self.shared.arrived.notify_all();
            return Ok(mine?);
        }
        let generation = state.generation;
        // A rank that is a thread of this process may be making an update (a broadcast's `set`)
        // that would wait for a call this thread is in: let go of the call's share meanwhile.
        module_core::update_lock::release_call_while(|| self.wait_round(state, generation, name))
    }

    /// Waits until the round `generation` completes: its combined result.
    fn wait_round(
        &self,
        mut state: MutexGuard<'_, State>,
        generation: u64,
        name: &'static str,
    ) -> Result<Option<Tensor>> {
        let deadline = self.shared.timeout.map(|t| Instant::now() + t);
        while state.generation == generation {
            if let Some(reason) = &state.poisoned {
                return Err(DistributedError::Poisoned {
                    reason: reason.clone(),
                }
                .into());
            }
            state = match deadline {
                None => self
                    .shared
                    .arrived
                    .wait(state)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let after = self.shared.timeout.unwrap_or_default();
                        state.poisoned = Some(format!(
                            "`{name}` timed out after {after:?} on rank {}",
                            self.rank
                        ));
                        self.shared.arrived.notify_all();
                        return Err(DistributedError::Timeout {
                            op: name,
                            rank: self.rank,
                            after,
                        }
                        .into());
                    }
                    self.shared
                        .arrived
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        let result = state.result.clone().unwrap_or(Ok(None));
        Ok(result?)
    }
}

impl LocalGroup {
    fn mailbox(&self) -> MutexGuard<'_, Mailbox> {
        // Every update of the mailbox completes before anything can panic.
        self.shared
            .mail
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Waits on the mailbox's condition variable until `done` or the deadline (an error).
    fn wait_mail<'a>(
        &self,
        mail: MutexGuard<'a, Mailbox>,
        op: &'static str,
        done: impl Fn(&Mailbox) -> bool,
    ) -> Result<MutexGuard<'a, Mailbox>> {
        // As a collective's round waits (see `run`).
        module_core::update_lock::release_call_while(|| self.wait_mail_locked(mail, op, done))
    }

    fn wait_mail_locked<'a>(
        &self,
        mut mail: MutexGuard<'a, Mailbox>,
        op: &'static str,
        done: impl Fn(&Mailbox) -> bool,
    ) -> Result<MutexGuard<'a, Mailbox>> {
        let deadline = self.shared.timeout.map(|t| Instant::now() + t);
        while !done(&mail) {
            mail = match deadline {
                None => self
                    .shared
                    .delivered
                    .wait(mail)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(DistributedError::Timeout {
                            op,
                            rank: self.rank,
                            after: self.shared.timeout.unwrap_or_default(),
                        }
                        .into());
                    }
                    self.shared
                        .delivered
                        .wait_timeout(mail, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        Ok(mail)
    }

    /// Posts a copy of `tensor` for `dst` and waits until `dst` has taken it: a synchronous send
    /// (MPI's `MPI_Ssend`), the strictest a send may be, so that an order of sends and receives
    /// that completes here completes on every engine.
    fn post(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        let message = tensor.to_device(&Device::Cpu)?.copy()?;
        let link = (self.rank, dst);
        let mut mail = self.mailbox();
        let seq = {
            let sent = mail.sent.entry(link).or_default();
            *sent += 1;
            *sent - 1
        };
        mail.queues
            .entry(link)
            .or_default()
            .push_back((seq, message));
        self.shared.delivered.notify_all();
        let taken = |m: &Mailbox| m.taken.get(&link).is_some_and(|&n| n > seq);
        match self.wait_mail(mail, "send", taken) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Withdraw the message unless it was taken meanwhile.
                let mut mail = self.mailbox();
                if let Some(queue) = mail.queues.get_mut(&link) {
                    queue.retain(|(s, _)| *s != seq);
                }
                Err(e)
            }
        }
    }

    /// Takes the oldest message `src` posted for this rank, waiting for one.
    fn take(&self, src: usize) -> Result<Tensor> {
        let link = (src, self.rank);
        let mail = self.mailbox();
        let ready = |m: &Mailbox| m.queues.get(&link).is_some_and(|q| !q.is_empty());
        let mut mail = self.wait_mail(mail, "recv", ready)?;
        let (_, message) = mail
            .queues
            .get_mut(&link)
            .and_then(VecDeque::pop_front)
            .expect("a message is waiting");
        *mail.taken.entry(link).or_default() += 1;
        self.shared.delivered.notify_all();
        Ok(message)
    }
}

/// Combines the ranks' parts, in rank order, or explains how they disagree.
fn combine(
    parts: Vec<(Op, Option<Tensor>)>,
    world: usize,
) -> std::result::Result<Option<Tensor>, DistributedError> {
    let describe = |parts: &[(Op, Option<Tensor>)]| {
        parts
            .iter()
            .enumerate()
            .map(|(rank, (op, t))| match t {
                Some(t) => format!("rank {rank}: {op:?} on {:?} {:?}", t.dtype(), t.dims()),
                None => format!("rank {rank}: {op:?}"),
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let (op, first) = (&parts[0].0.clone(), &parts[0].1.clone());
    let same = parts.iter().all(|(o, t)| {
        o == op
            && match (t, first) {
                (Some(t), Some(f)) => t.dtype() == f.dtype() && t.elem_count() == f.elem_count(),
                (None, None) => true,
                _ => false,
            }
    });
    if !same {
        return Err(DistributedError::OpMismatch {
            detail: describe(&parts),
        });
    }
    let backend = |e: candle_core::Error| DistributedError::Backend {
        backend: "local",
        message: e.to_string(),
    };
    match op {
        Op::Barrier => Ok(None),
        Op::Broadcast(root) => Ok(parts[*root].1.clone()),
        Op::AllGather => {
            let blocks: Vec<Tensor> = parts.into_iter().filter_map(|(_, t)| t).collect();
            Ok(Some(Tensor::cat(&blocks, 0).map_err(backend)?))
        }
        Op::AllReduce(reduce) | Op::ReduceScatter(reduce) => {
            let mut tensors = parts.into_iter().filter_map(|(_, t)| t);
            let mut sum = tensors.next().expect("a world has a rank");
            for t in tensors {
                sum = (sum + t).map_err(backend)?;
            }
            if *reduce == ReduceOp::Avg && world > 1 {
                sum = (sum / world as f64).map_err(backend)?;
            }
            Ok(Some(sum))
        }
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        check_contiguous(tensor)?;
        // A private copy on the CPU: the other ranks read it after this call returns.
        let mine = tensor.flatten_all()?.to_device(&Device::Cpu)?.copy()?;
        let sum = self.run(Op::AllReduce(op), "all_reduce", Some(mine))?;
        write_into(tensor, &sum.expect("all_reduce has a result"))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        check_root(root, self.shared.world_size)?;
        check_contiguous(tensor)?;
        let mine = tensor.flatten_all()?.to_device(&Device::Cpu)?.copy()?;
        let value = self.run(Op::Broadcast(root), "broadcast", Some(mine))?;
        if self.rank != root {
            write_into(tensor, &value.expect("broadcast has a result"))?;
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.run(Op::Barrier, "barrier", None).map(|_| ())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        check_gather(input, output, self.shared.world_size, "all_gather")?;
        let mine = input.flatten_all()?.to_device(&Device::Cpu)?.copy()?;
        let all = self.run(Op::AllGather, "all_gather", Some(mine))?;
        write_into(output, &all.expect("all_gather has a result"))
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let n = check_gather(output, input, self.shared.world_size, "reduce_scatter")?;
        let mine = input.flatten_all()?.to_device(&Device::Cpu)?.copy()?;
        let all = self.run(Op::ReduceScatter(op), "reduce_scatter", Some(mine))?;
        let all = all.expect("reduce_scatter has a result");
        write_into(output, &all.narrow(0, self.rank * n, n)?)
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        check_peer("send", dst, self.rank, self.shared.world_size)?;
        self.post(tensor, dst)
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        check_peer("recv", src, self.rank, self.shared.world_size)?;
        check_contiguous(tensor)?;
        let message = self.take(src)?;
        check_received(tensor, src, message.dtype(), message.dims())?;
        write_into(tensor, &message)
    }

    fn backend(&self) -> &'static str {
        "local"
    }
}
