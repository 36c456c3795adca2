//! [`Nccl`]: the process group of a multi-GPU job, through NCCL (cudarc's bindings, which
//! candle's `nccl` feature enables), on candle's own CUDA stream.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::CudaViewMut;
use candle_core::cuda::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclReduceOp};
use candle_core::{CpuStorage, CudaDevice, CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};

use super::collective::{check_contiguous, check_peer, check_received, check_root};
use super::rendezvous::{fetch_blob, rendezvous_port, RendezvousServer};
use super::{Collective, DistEnv, DistributedError, ReduceOp};
use crate::Result;

/// PyTorch's default NCCL timeout (`torch.distributed.constants.default_pg_nccl_timeout`).
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(600);
/// How long [`Nccl::from_env`] waits for every rank to reach the rendezvous.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The NCCL process group: one process per GPU, collectives run by NCCL on the candle device's
/// own CUDA stream (so they are ordered with candle's kernels, with no extra synchronization).
/// Behind the `nccl` feature, which needs `libnccl.so` to link and run.
///
/// Tensors are reduced in place, in their own dtype, with no host copy: `f32`, `f64`, `f16`,
/// `bf16` (sum and mean, NCCL's `ncclSum`/`ncclAvg`), `i64`, `u32`, `u8`, `i32` (sum; a mean of
/// integers is refused, as with [`Mpi`](super::Mpi)); broadcasts take those dtypes. Every tensor
/// must be contiguous and on this engine's GPU ([`device`](Collective::device)); a CPU tensor is
/// a [`DistributedError::Unsupported`] naming the device it should be on. Point-to-point
/// [`send`](Collective::send) and [`recv`](Collective::recv) are `ncclSend`/`ncclRecv` of a
/// header (the dtype and shape, 80 bytes) and then of the values, so a receiver expecting another
/// shape still takes the message (into scratch memory) and reports the mismatch.
///
/// **Timeout.** NCCL's collectives are asynchronous: a rank that never joins leaves the others'
/// kernels spinning forever. With a timeout (the default, [`DEFAULT_NCCL_TIMEOUT`], PyTorch's),
/// each collective waits for its own completion on the stream, polling a CUDA event; past the
/// deadline the communicator is aborted (`ncclCommAbort`, which also stops the kernels), the
/// call fails with [`DistributedError::Timeout`] and every later one with
/// [`DistributedError::Poisoned`]. That wait makes each collective synchronous with the host;
/// [`with_timeout(None)`](Self::with_timeout) keeps them fully asynchronous, without a timeout.
/// Creating the communicator cannot time out (cudarc wraps `ncclCommInitRank` only in its
/// blocking form), but [`from_env`](Self::from_env) only gets there once the rendezvous saw
/// every rank.
///
/// **Threads.** The communicator is `!Send`: make the value on the thread that trains (one
/// process per GPU, as with `torchrun`) and keep it there.
///
/// **Untested on hardware**: it is compiled in CI but no GPU was available to this project, so
/// neither world size 1 on CUDA nor several GPUs have been run. `tests/distributed_nccl.rs`
/// holds the world-size-1 checks, which skip loudly without a CUDA device.
pub struct Nccl {
    /// `None` once aborted after a timeout.
    comm: RefCell<Option<Comm>>,
    device: CudaDevice,
    rank: usize,
    world_size: usize,
    timeout: Option<Duration>,
    poisoned: RefCell<Option<String>>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device().location())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Nccl {
    /// A fresh NCCL unique id, made on rank 0 and handed to the other ranks (see
    /// [`id_bytes`](Self::id_bytes)) before each calls [`new`](Self::new).
    pub fn new_id() -> Result<Id> {
        Id::new().map_err(|e| backend(format!("ncclGetUniqueId: {e:?}")))
    }

    /// The 128 bytes of an id, to send to the other ranks.
    pub fn id_bytes(id: &Id) -> [u8; 128] {
        id.internal().map(|c| c as u8)
    }

    /// The id whose bytes [`id_bytes`](Self::id_bytes) gave; `None` unless `bytes` is 128 long.
    pub fn id_from_bytes(bytes: &[u8]) -> Option<Id> {
        let bytes: &[u8; 128] = bytes.try_into().ok()?;
        Some(Id::uninit(bytes.map(|b| b as std::ffi::c_char)))
    }

    /// Joins the communicator `id` as `rank` of `world_size`, on `device`'s stream. Every rank
    /// must call it with the same id and world size; it returns once all have (NCCL's
    /// `ncclCommInitRank`).
    pub fn new(rank: usize, world_size: usize, device: &CudaDevice, id: Id) -> Result<Nccl> {
        if rank >= world_size {
            return Err(DistributedError::InvalidRank { rank, world_size }.into());
        }
        let comm = Comm::from_rank(device.cuda_stream(), rank, world_size, id).map_err(|e| {
            backend(format!(
                "ncclCommInitRank (rank {rank} of {world_size}): {e:?}"
            ))
        })?;
        Ok(Nccl {
            comm: RefCell::new(Some(comm)),
            device: device.clone(),
            rank,
            world_size,
            timeout: Some(DEFAULT_NCCL_TIMEOUT),
            poisoned: RefCell::new(None),
        })
    }

    /// The process group a `torchrun`-style launch describes (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`): the GPU `cuda:LOCAL_RANK`, and the unique id
    /// made by rank 0 and fetched by the others over the TCP rendezvous at `MASTER_ADDR` on the
    /// port [`rendezvous_port`] picks (`MASTER_PORT + 1` under `torchrun`), waiting at most
    /// [`RENDEZVOUS_TIMEOUT`] for every rank.
    pub fn from_env() -> Result<Nccl> {
        Self::from_dist_env(&DistEnv::from_env()?, |name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) with the job already read, and `var` for the rendezvous
    /// port's variables. The GPU is `parse_device("cuda:LOCAL_RANK")` (`cuda:0` for a world of
    /// 1 without `LOCAL_RANK`).
    pub fn from_dist_env(env: &DistEnv, var: impl Fn(&str) -> Option<String>) -> Result<Nccl> {
        let (rank, world) = (env.rank, env.world_size);
        let local_rank = match env.local_rank {
            Some(local) => local,
            None if world == 1 => 0,
            None => {
                return Err(DistributedError::Env {
                    reason: format!(
                        "rank {rank} of {world} has no LOCAL_RANK to pick its GPU with (torchrun \
                         sets it)"
                    ),
                }
                .into())
            }
        };
        // The process-wide handle, so that `parse_device("cuda:N")` elsewhere gives the same
        // device (candle does not mix tensors of two handles to one GPU).
        let device = match crate::parse_device(&format!("cuda:{local_rank}"))? {
            Device::Cuda(device) => device,
            other => return Err(backend(format!("cuda:{local_rank} opened as {other:?}"))),
        };
        let id = if world == 1 {
            Self::new_id()?
        } else {
            let Some((host, master_port)) = &env.master else {
                return Err(DistributedError::Env {
                    reason: format!("a world of {world} needs MASTER_ADDR and MASTER_PORT"),
                }
                .into());
            };
            let port = rendezvous_port(*master_port, var)?;
            if rank == 0 {
                // Listen before making the id, so early peers find the port open sooner.
                let server = RendezvousServer::bind_port(port)?;
                let id = Self::new_id()?;
                server.serve(world, &Self::id_bytes(&id), RENDEZVOUS_TIMEOUT)?;
                id
            } else {
                let bytes = fetch_blob(host, port, rank, world, RENDEZVOUS_TIMEOUT)?;
                Self::id_from_bytes(&bytes).ok_or_else(|| {
                    backend(format!(
                        "rank 0 sent {} bytes, not a 128-byte NCCL id",
                        bytes.len()
                    ))
                })?
            }
        };
        Self::new(rank, world, &device, id)
    }

    /// The same group with another collective timeout (`None`: no timeout, and collectives
    /// stay asynchronous on the stream).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Nccl {
        self.timeout = timeout;
        self
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The GPU this rank's collectives run on.
    pub fn cuda_device(&self) -> &CudaDevice {
        &self.device
    }

    /// Checks `tensor`, enqueues `call` on it, and waits for it within the timeout.
    fn run(&self, tensor: &Tensor, call: Call) -> Result<()> {
        if let Some(reason) = self.poisoned.borrow().as_ref() {
            return Err(DistributedError::Poisoned {
                reason: reason.clone(),
            }
            .into());
        }
        check_contiguous(tensor)?;
        let device = self.device();
        if !tensor.device().same_device(&device) {
            return Err(unsupported(format!(
                "a tensor on {:?}: it needs tensors on {:?}, its GPU (`tensor.to_device(&comm.device())`)",
                tensor.device().location(),
                device.location()
            )));
        }
        let dtype = tensor.dtype();
        let integer = match dtype {
            DType::U8 | DType::U32 | DType::I32 | DType::I64 => true,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => false,
            _ => return Err(unsupported(format!("{dtype:?} (NCCL has no such type)"))),
        };
        if call == Call::AllReduce(ReduceOp::Avg) && integer {
            return Err(unsupported(format!("a mean all-reduce of {dtype:?}")));
        }
        {
            // The borrow ends before `wait`, which takes the communicator away on a timeout.
            let comm = self.comm.borrow();
            let comm = comm.as_ref().expect("a communicator that is not poisoned");
            tensor
                .inplace_op1(&NcclCall { comm, call })
                .map_err(|e| backend(format!("{call:?} of {dtype:?}: {e}")))?;
        }
        self.wait(call)
    }

    /// Waits for the stream to reach the collective just enqueued, aborting the communicator
    /// past the deadline.
    fn wait(&self, call: Call) -> Result<()> {
        let Some(timeout) = self.timeout else {
            return Ok(());
        };
        let stream = self.device.cuda_stream();
        let done = stream
            .record_event(None)
            .map_err(|e| backend(format!("cuEventRecord: {e:?}")))?;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(10);
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Ok(false) => {
                    let op = call.name();
                    *self.poisoned.borrow_mut() = Some(format!(
                        "`{op}` timed out after {timeout:?} and the NCCL communicator was aborted"
                    ));
                    // Dropping cudarc's `Comm` calls `ncclCommAbort`, which ends the kernels.
                    self.comm.borrow_mut().take();
                    return Err(DistributedError::Timeout {
                        op,
                        rank: self.rank,
                        after: timeout,
                    }
                    .into());
                }
                Err(e) => return Err(backend(format!("{}: {e:?}", call.name()))),
            }
        }
    }
}

fn backend(message: String) -> crate::Error {
    DistributedError::Backend {
        backend: "nccl",
        message,
    }
    .into()
}

fn unsupported(what: String) -> crate::Error {
    DistributedError::Unsupported {
        backend: "nccl",
        what,
    }
    .into()
}

/// One collective or point-to-point operation, as [`Nccl::run`] enqueues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    AllReduce(ReduceOp),
    Broadcast(usize),
    /// `ncclSend` to the peer.
    Send(usize),
    /// `ncclRecv` from the peer.
    Recv(usize),
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::AllReduce(_) => "all_reduce",
            Call::Broadcast(_) => "broadcast",
            Call::Send(_) => "send",
            Call::Recv(_) => "recv",
        }
    }
}

/// The dtypes a point-to-point message carries, by their code in its header.
const P2P_DTYPES: [DType; 8] = [
    DType::U8,
    DType::U32,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// The most dimensions a point-to-point message may have (its header's fixed size).
const P2P_MAX_DIMS: usize = 8;

impl Nccl {
    /// The header that goes before a message: `[dtype code, rank, dims.., 0..]` as `i64`s on
    /// this GPU, so the receiver can check (and, if refused, still consume) the message.
    fn header(&self, tensor: &Tensor) -> Result<Tensor> {
        let dtype = tensor.dtype();
        let code = P2P_DTYPES.iter().position(|&d| d == dtype);
        let (Some(code), true) = (code, tensor.rank() <= P2P_MAX_DIMS) else {
            return Err(unsupported(format!(
                "a send of a {dtype:?} tensor of shape {:?} (at most {P2P_MAX_DIMS} dimensions)",
                tensor.dims()
            )));
        };
        let mut words = vec![code as i64, tensor.rank() as i64];
        words.extend(tensor.dims().iter().map(|&d| d as i64));
        words.resize(P2P_MAX_DIMS + 2, 0);
        Ok(Tensor::new(words, &self.device())?)
    }
}

/// The collective as a candle in-place op: candle hands over the tensor's `CudaStorage` under
/// its write lock, and the collective reads and writes the tensor's range of it.
struct NcclCall<'a> {
    comm: &'a Comm,
    call: Call,
}

impl NcclCall<'_> {
    fn enqueue<T: NcclType>(&self, mut view: CudaViewMut<'_, T>) -> candle_core::Result<()> {
        let status = match self.call {
            Call::AllReduce(op) => {
                let op = match op {
                    ReduceOp::Sum => NcclReduceOp::Sum,
                    ReduceOp::Avg => NcclReduceOp::Avg,
                };
                self.comm.all_reduce_in_place(&mut view, &op).map(drop)
            }
            // Roots and peers were checked against the world size, which fits in an i32.
            Call::Broadcast(root) => self
                .comm
                .broadcast_in_place(&mut view, root as i32)
                .map(drop),
            Call::Send(peer) => self.comm.send(&view, peer as i32).map(drop),
            Call::Recv(peer) => self.comm.recv(&mut view, peer as i32).map(drop),
        };
        status
            .map(drop)
            .map_err(|e| candle_core::Error::Msg(format!("NCCL error {e:?}")))
    }
}

impl InplaceOp1 for NcclCall<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // `Nccl::run` refuses tensors that are not on its GPU before getting here.
        Err(candle_core::Error::Msg("NCCL needs a CUDA tensor".into()))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or(candle_core::Error::RequiresContiguous { op: "nccl" })?;
        match storage.dtype() {
            DType::F32 => self.enqueue(storage.as_cuda_slice_mut::<f32>()?.slice_mut(start..end)),
            DType::F64 => self.enqueue(storage.as_cuda_slice_mut::<f64>()?.slice_mut(start..end)),
            DType::F16 => self.enqueue(
                storage
                    .as_cuda_slice_mut::<half::f16>()?
                    .slice_mut(start..end),
            ),
            DType::BF16 => self.enqueue(
                storage
                    .as_cuda_slice_mut::<half::bf16>()?
                    .slice_mut(start..end),
            ),
            DType::I64 => self.enqueue(storage.as_cuda_slice_mut::<i64>()?.slice_mut(start..end)),
            DType::I32 => self.enqueue(storage.as_cuda_slice_mut::<i32>()?.slice_mut(start..end)),
            DType::U32 => self.enqueue(storage.as_cuda_slice_mut::<u32>()?.slice_mut(start..end)),
            DType::U8 => self.enqueue(storage.as_cuda_slice_mut::<u8>()?.slice_mut(start..end)),
            // `Nccl::run` refuses the other dtypes before getting here.
            dtype => Err(candle_core::Error::Msg(format!(
                "NCCL has no type for {dtype:?}"
            ))),
        }
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.run(tensor, Call::AllReduce(op))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        check_root(root, self.world_size)?;
        self.run(tensor, Call::Broadcast(root))
    }

    /// `ncclSend` of a header (dtype and shape, 80 bytes) and then of the values, on the stream;
    /// NCCL's point-to-point operations block the stream until the peer receives.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        check_peer("send", dst, self.rank, self.world_size)?;
        let header = self.header(tensor)?;
        let values = tensor.contiguous()?;
        self.run(&header, Call::Send(dst))?;
        self.run(&values, Call::Send(dst))
    }

    /// `ncclRecv` of the header, checked against `tensor`, then of the values into `tensor`; a
    /// message of another shape or dtype is received into a scratch tensor (so the peer's
    /// send completes) and refused.
    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        check_peer("recv", src, self.rank, self.world_size)?;
        check_contiguous(tensor)?;
        let header = Tensor::zeros(P2P_MAX_DIMS + 2, DType::I64, &self.device())?;
        self.run(&header, Call::Recv(src))?;
        let words: Vec<i64> = header.to_vec1()?;
        let dtype = *P2P_DTYPES
            .get(words[0] as usize)
            .ok_or_else(|| backend(format!("rank {src} sent a header without a dtype")))?;
        let rank = (words[1] as usize).min(P2P_MAX_DIMS);
        let dims: Vec<usize> = words[2..2 + rank].iter().map(|&d| d as usize).collect();
        if let Err(e) = check_received(tensor, src, dtype, &dims) {
            let scratch = Tensor::zeros(dims.as_slice(), dtype, &self.device())?;
            self.run(&scratch, Call::Recv(src))?;
            return Err(e);
        }
        self.run(tensor, Call::Recv(src))
    }

    /// An all-reduce of one element: NCCL has no barrier of its own (PyTorch's NCCL barrier is
    /// the same trick).
    fn barrier(&self) -> Result<()> {
        let device = self.device();
        let one = Tensor::ones(1, DType::F32, &device)?;
        self.all_reduce(&one, ReduceOp::Sum)?;
        // Without a timeout the all-reduce is only enqueued: wait for it here.
        device.synchronize()?;
        Ok(())
    }

    fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }
}
