//! The collective interface every engine implements, and the single-process engine.

use candle_core::{DType, Device, Tensor};

use super::DistributedError;
use crate::Result;

/// How [`Collective::all_reduce`] combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The element-wise sum over ranks.
    Sum,
    /// The element-wise mean over ranks (the sum divided by the world size).
    Avg,
}

/// A process group: the ranks of one data-parallel job and the collectives they run together.
///
/// One value per process (or, for [`LocalGroup`](super::LocalGroup), per thread). Every rank must
/// call the same collectives in the same order with tensors of the same size and dtype, as with
/// MPI, NCCL or `torch.distributed`. The operations work **in place** on a contiguous tensor
/// (for instance a fresh `Tensor::cat` of flattened gradients, or a `flatten_all` view of a
/// contiguous tensor, which shares its storage): its storage is overwritten with the result.
///
/// Engines in this crate: [`SingleProcess`] (world size 1, the default; no dependency),
/// [`LocalGroup`](super::LocalGroup) (ranks as threads of one process, for tests and examples),
/// `Mpi` with the `mpi` feature and `Nccl` with the `nccl` feature. The trait is object safe: [`init_from_env`](super::init_from_env)
/// returns a `Box<dyn Collective>`.
///
/// # The NCCL engine
///
/// With the `nccl` feature, `Nccl` is the GPU engine: NCCL's communicator on the candle device's
/// own CUDA stream, the tensor's `CudaStorage` reduced in place through
/// [`Tensor::inplace_op1`], the 128-byte unique id handed from rank 0 to the others by a TCP
/// rendezvous ([`RendezvousServer`](super::RendezvousServer), [`fetch_blob`](super::fetch_blob)).
/// It is compiled in CI but has never run: no GPU was available to this project.
pub trait Collective {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// Combines `tensor` over all ranks with `op`, in place: afterwards every rank holds the
    /// same result. `tensor` must be contiguous.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;

    /// Overwrites `tensor` on every rank with its value on `root`, in place. `tensor` must be
    /// contiguous and have the same shape and dtype on every rank.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()>;

    /// Returns once every rank has called it (for instance after rank 0 saved a checkpoint).
    fn barrier(&self) -> Result<()>;

    /// Concatenates every rank's `input` into `output`, in rank order, on every rank
    /// (`torch.distributed.all_gather_into_tensor`, `MPI_Allgather`): rank `r`'s `n` elements
    /// land at `output[r * n..(r + 1) * n]`. Both contiguous, of one dtype, `output` of
    /// `world_size() * n` elements (any shape: it is written flat); anything else is
    /// [`DistributedError::OpMismatch`] naming the sizes.
    ///
    /// The default implementation is one [`broadcast`](Self::broadcast) per rank, correct on any
    /// engine; the in-process and MPI engines run it natively.
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let n = check_gather(input, output, self.world_size(), "all_gather")?;
        let out = output.flatten_all()?;
        for root in 0..self.world_size() {
            let block = if root == self.rank() {
                input.flatten_all()?.copy()?
            } else {
                Tensor::zeros(n, input.dtype(), input.device())?
            };
            self.broadcast(&block, root)?;
            out.slice_set(&block.to_device(out.device())?, 0, root * n)?;
        }
        Ok(())
    }

    /// Combines `input` over all ranks with `op` and leaves block `rank()` of the result in
    /// `output` (`torch.distributed.reduce_scatter_tensor`, `MPI_Reduce_scatter_block`): `input`
    /// holds `world_size()` blocks of `output`'s `n` elements, and rank `r` receives the
    /// combination of every rank's block `r`. Both contiguous, of one dtype; other sizes are
    /// [`DistributedError::OpMismatch`].
    ///
    /// The default implementation all-reduces a copy of `input` and keeps this rank's block
    /// (correct on any engine, the same sums as [`all_reduce`](Self::all_reduce)); the
    /// in-process and MPI engines run it natively.
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let n = check_gather(output, input, self.world_size(), "reduce_scatter")?;
        let all = input.flatten_all()?.copy()?;
        self.all_reduce(&all, op)?;
        write_into(output, &all.narrow(0, self.rank() * n, n)?)
    }

    /// Sends `tensor` to rank `dst` (`torch.distributed.send`), to be taken by its matching
    /// [`recv`](Self::recv). Blocking: it may wait until `dst` has received it (MPI's standard
    /// send, NCCL; the in-process engine always waits), so two ranks that send to each other at
    /// once wait forever: order the calls (the pipeline schedules do). Any layout; the shape and
    /// dtype travel with the values, and a receiver expecting others gets
    /// [`DistributedError::OpMismatch`]. `dst` must be another rank of the group
    /// ([`DistributedError::InvalidRank`], [`DistributedError::PeerIsSelf`]).
    ///
    /// The default implementation is [`DistributedError::Unsupported`]: the in-process, MPI
    /// and NCCL engines implement it.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        check_peer("send", dst, self.rank(), self.world_size())?;
        let _ = tensor;
        Err(DistributedError::Unsupported {
            backend: self.backend(),
            what: "point-to-point send".into(),
        }
        .into())
    }

    /// Receives into `tensor`, in place, what rank `src` sent with [`send`](Self::send)
    /// (`torch.distributed.recv`); messages from one rank arrive in the order they were sent.
    /// `tensor` must be contiguous and have the sent shape and dtype: anything else is
    /// [`DistributedError::OpMismatch`] naming both (the message is consumed, `tensor` left as
    /// it was). `src` must be another rank of the group.
    ///
    /// The default implementation is [`DistributedError::Unsupported`].
    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        check_peer("recv", src, self.rank(), self.world_size())?;
        let _ = tensor;
        Err(DistributedError::Unsupported {
            backend: self.backend(),
            what: "point-to-point recv".into(),
        }
        .into())
    }

    /// The device this rank's model and tensors belong on: `cuda:LOCAL_RANK` for NCCL, the CPU
    /// (the default) for engines that stage tensors through host memory and so take any device.
    /// Build the model on it: `DigitNet::new(&comm.device())`.
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// The engine's name, for messages (`"single-process"`, `"local"`, `"mpi"`, `"nccl"`).
    fn backend(&self) -> &'static str;
}

/// The one-rank process group: every collective is a no-op (a sum or mean over one rank is the
/// tensor itself), so a program written for data parallelism runs unchanged, and bit for bit as
/// without it, in a single process. It is what [`init_from_env`](super::init_from_env) returns
/// when no launcher variables are set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&self, tensor: &Tensor, _op: ReduceOp) -> Result<()> {
        check_contiguous(tensor)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        check_root(root, 1)?;
        check_contiguous(tensor)
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "single-process"
    }
}

/// A root that is not a rank is an error, not a hang.
pub(crate) fn check_root(root: usize, world_size: usize) -> Result<()> {
    if root < world_size {
        Ok(())
    } else {
        Err(DistributedError::InvalidRank {
            rank: root,
            world_size,
        }
        .into())
    }
}

/// A peer of a point-to-point operation must be another rank of the group.
pub(crate) fn check_peer(
    op: &'static str,
    peer: usize,
    rank: usize,
    world_size: usize,
) -> Result<()> {
    check_root(peer, world_size)?;
    if peer == rank {
        return Err(DistributedError::PeerIsSelf { op, rank }.into());
    }
    Ok(())
}

/// Refuses a received message of another shape or dtype than the tensor it should fill.
pub(crate) fn check_received(
    tensor: &Tensor,
    src: usize,
    dtype: DType,
    dims: &[usize],
) -> Result<()> {
    if tensor.dtype() == dtype && tensor.dims() == dims {
        return Ok(());
    }
    Err(DistributedError::OpMismatch {
        detail: format!(
            "`recv` from rank {src} into a {:?} tensor of shape {:?}, but rank {src} sent a \
             {dtype:?} tensor of shape {dims:?}",
            tensor.dtype(),
            tensor.dims()
        ),
    }
    .into())
}

/// The in-place operations write through the tensor's storage, which needs a contiguous layout.
pub(crate) fn check_contiguous(tensor: &Tensor) -> Result<()> {
    if tensor.is_contiguous() {
        Ok(())
    } else {
        Err(candle_core::Error::RequiresContiguous { op: "collective" }.into())
    }
}

/// Checks the sizes of an all-gather (`block` of `n` elements on each rank, `whole` of
/// `world * n`), and a reduce-scatter the other way round; returns `n`.
pub(crate) fn check_gather(
    block: &Tensor,
    whole: &Tensor,
    world: usize,
    op: &'static str,
) -> Result<usize> {
    check_contiguous(block)?;
    check_contiguous(whole)?;
    let n = block.elem_count();
    if whole.elem_count() != world * n || block.dtype() != whole.dtype() {
        return Err(DistributedError::OpMismatch {
            detail: format!(
                "`{op}` over {world} ranks needs a block of n elements and a whole of {world} * n \
                 of the same dtype: got a block of {n} {:?} and a whole of {} {:?}",
                block.dtype(),
                whole.elem_count(),
                whole.dtype()
            ),
        }
        .into());
    }
    Ok(n)
}

/// Writes `value` (any layout, dtype or device; `tensor`'s element count) into `tensor`'s
/// storage, in place. `tensor` must be contiguous.
pub(crate) fn write_into(tensor: &Tensor, value: &Tensor) -> Result<()> {
    check_contiguous(tensor)?;
    let dst = tensor.flatten_all()?;
    let src = value
        .to_dtype(tensor.dtype())?
        .to_device(tensor.device())?
        .flatten_all()?
        // A fresh storage: `slice_set` refuses a source that shares the destination's.
        .copy()?;
    if src.elem_count() != dst.elem_count() {
        return Err(DistributedError::OpMismatch {
            detail: format!(
                "a result of {} elements for a tensor of {}",
                src.elem_count(),
                dst.elem_count()
            ),
        }
        .into());
    }
    dst.slice_set(&src, 0, 0)?;
    Ok(())
}
