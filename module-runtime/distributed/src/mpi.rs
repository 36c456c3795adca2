//! [`Mpi`]: the process group of an MPI job (`mpiexec -n N`), through rsmpi.

use candle_core::{DType, Device, Tensor, WithDType};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Equivalence, Root, Source};

use super::collective::{
    check_contiguous, check_gather, check_peer, check_received, check_root, write_into,
};
use super::{Collective, DistributedError, ReduceOp};
use crate::Result;

/// The MPI process group (`MPI_COMM_WORLD`), for CPU clusters and for testing data-parallel
/// code with several processes on one machine (`mpiexec -n 2 ./train`). Behind the `mpi`
/// feature, which needs an MPI library with `mpicc` (MPICH or Open MPI) and libclang to build.
///
/// Tensors are staged through host memory: floating-point ones are reduced in `f32` (`f64` for
/// `F64`; MPI has no `bf16`/`f16`, so those are summed in `f32` and rounded back), integer ones
/// in their own type; broadcasts copy the bits of any dtype but the 8-bit float formats. Sums
/// are MPI's `MPI_SUM`, whose order MPI leaves to the implementation, but every rank receives the
/// same result.
///
/// **No timeout**: MPI's blocking collectives cannot be cancelled, and abandoning a pending
/// non-blocking one is undefined, so a rank that never joins hangs the others. Use the
/// launcher's timeout (`mpiexec -timeout SECONDS` or `MPIEXEC_TIMEOUT` with MPICH's Hydra,
/// `mpirun --timeout` with Open MPI); [`DistributedDataParallel::new`](super::DistributedDataParallel::new)
/// already turns the likeliest cause, ranks that built different models, into an error on every
/// rank.
///
/// MPI is initialized once per process, with `MPI_THREAD_FUNNELED`: make the value on the main
/// thread (or the one thread that runs the training) and call it from that thread; dropping it
/// finalizes MPI.
pub struct Mpi {
    world: SimpleCommunicator,
    // Dropped last: finalizes MPI.
    _universe: Universe,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

impl Mpi {
    /// Initializes MPI and takes its world communicator. Fails if MPI was initialized before in
    /// this process.
    pub fn init() -> Result<Mpi> {
        let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| {
                backend("MPI is already initialized in this process (one `Mpi` per process)")
            })?;
        Ok(Mpi {
            world: universe.world(),
            _universe: universe,
        })
    }

    fn sum<T: WithDType + Equivalence>(&self, tensor: &Tensor) -> Result<Vec<T>> {
        let send: Vec<T> = host(tensor)?;
        let mut recv = send.clone();
        self.world
            .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        Ok(recv)
    }

    fn gather<T: WithDType + Equivalence>(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let send: Vec<T> = host(input)?;
        let mut recv = vec![T::from_f64(0.0); output.elem_count()];
        self.world.all_gather_into(&send[..], &mut recv[..]);
        write_back(output, recv)
    }

    fn gather_bits<T: WithDType>(
        &self,
        input: &Tensor,
        output: &Tensor,
        to_bits: fn(T) -> u16,
        from_bits: fn(u16) -> T,
    ) -> Result<()> {
        let send: Vec<u16> = host::<T>(input)?.into_iter().map(to_bits).collect();
        let mut recv = vec![0u16; output.elem_count()];
        self.world.all_gather_into(&send[..], &mut recv[..]);
        write_back(output, recv.into_iter().map(from_bits).collect::<Vec<T>>())
    }

    fn scatter_sum<T: WithDType + Equivalence>(&self, input: &Tensor, n: usize) -> Result<Vec<T>> {
        let send: Vec<T> = host(input)?;
        let mut recv = vec![T::from_f64(0.0); n];
        self.world
            .reduce_scatter_block_into(&send[..], &mut recv[..], SystemOperation::sum());
        Ok(recv)
    }

    fn bcast<T: WithDType + Equivalence>(&self, tensor: &Tensor, root: usize) -> Result<()> {
        let mut buf: Vec<T> = host(tensor)?;
        self.world
            .process_at_rank(root as i32)
            .broadcast_into(&mut buf[..]);
        write_back(tensor, buf)
    }

    fn bcast_bits<T: WithDType>(
        &self,
        tensor: &Tensor,
        root: usize,
        to_bits: fn(T) -> u16,
        from_bits: fn(u16) -> T,
    ) -> Result<()> {
        let mut bits: Vec<u16> = host::<T>(tensor)?.into_iter().map(to_bits).collect();
        self.world
            .process_at_rank(root as i32)
            .broadcast_into(&mut bits[..]);
        write_back(tensor, bits.into_iter().map(from_bits).collect::<Vec<T>>())
    }
}

fn backend(message: &str) -> crate::Error {
    DistributedError::Backend {
        backend: "mpi",
        message: message.to_string(),
    }
    .into()
}

fn unsupported(what: String) -> crate::Error {
    DistributedError::Unsupported {
        backend: "mpi",
        what,
    }
    .into()
}

/// The tensor's values in host memory, as `T`.
fn host<T: WithDType>(tensor: &Tensor) -> Result<Vec<T>> {
    Ok(tensor
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(T::DTYPE)?
        .to_vec1::<T>()?)
}

/// Writes host values back into the tensor's own storage (its dtype and device).
fn write_back<T: WithDType>(tensor: &Tensor, values: Vec<T>) -> Result<()> {
    let n = values.len();
    write_into(tensor, &Tensor::from_vec(values, n, &Device::Cpu)?)
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        check_contiguous(tensor)?;
        let world = self.world_size();
        match tensor.dtype() {
            DType::F64 => {
                let mut v = self.sum::<f64>(tensor)?;
                if op == ReduceOp::Avg {
                    v.iter_mut().for_each(|x| *x /= world as f64);
                }
                write_back(tensor, v)
            }
            DType::F32 | DType::BF16 | DType::F16 => {
                let mut v = self.sum::<f32>(tensor)?;
                if op == ReduceOp::Avg {
                    v.iter_mut().for_each(|x| *x /= world as f32);
                }
                write_back(tensor, v)
            }
            DType::I64 | DType::U32 | DType::U8 if op == ReduceOp::Sum => match tensor.dtype() {
                DType::I64 => write_back(tensor, self.sum::<i64>(tensor)?),
                DType::U32 => write_back(tensor, self.sum::<u32>(tensor)?),
                _ => write_back(tensor, self.sum::<u8>(tensor)?),
            },
            dtype => Err(unsupported(format!("{op:?} all-reduce of {dtype:?}"))),
        }
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        check_root(root, self.world_size())?;
        check_contiguous(tensor)?;
        match tensor.dtype() {
            DType::F64 => self.bcast::<f64>(tensor, root),
            DType::F32 => self.bcast::<f32>(tensor, root),
            DType::I64 => self.bcast::<i64>(tensor, root),
            DType::U32 => self.bcast::<u32>(tensor, root),
            DType::U8 => self.bcast::<u8>(tensor, root),
            DType::BF16 => {
                self.bcast_bits::<half::bf16>(tensor, root, |x| x.to_bits(), half::bf16::from_bits)
            }
            DType::F16 => {
                self.bcast_bits::<half::f16>(tensor, root, |x| x.to_bits(), half::f16::from_bits)
            }
            dtype => Err(unsupported(format!("a broadcast of {dtype:?}"))),
        }
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        check_gather(input, output, self.world_size(), "all_gather")?;
        // Bits, not values: every dtype arrives exactly as it left its rank.
        match input.dtype() {
            DType::F64 => self.gather::<f64>(input, output),
            DType::F32 => self.gather::<f32>(input, output),
            DType::I64 => self.gather::<i64>(input, output),
            DType::U32 => self.gather::<u32>(input, output),
            DType::U8 => self.gather::<u8>(input, output),
            DType::BF16 => self.gather_bits::<half::bf16>(
                input,
                output,
                |x| x.to_bits(),
                half::bf16::from_bits,
            ),
            DType::F16 => {
                self.gather_bits::<half::f16>(input, output, |x| x.to_bits(), half::f16::from_bits)
            }
            dtype => Err(unsupported(format!("an all-gather of {dtype:?}"))),
        }
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let n = check_gather(output, input, self.world_size(), "reduce_scatter")?;
        let world = self.world_size();
        match input.dtype() {
            DType::F64 => {
                let mut v = self.scatter_sum::<f64>(input, n)?;
                if op == ReduceOp::Avg {
                    v.iter_mut().for_each(|x| *x /= world as f64);
                }
                write_back(output, v)
            }
            DType::F32 | DType::BF16 | DType::F16 => {
                let mut v = self.scatter_sum::<f32>(input, n)?;
                if op == ReduceOp::Avg {
                    v.iter_mut().for_each(|x| *x /= world as f32);
                }
                write_back(output, v)
            }
            DType::I64 | DType::U32 | DType::U8 if op == ReduceOp::Sum => match input.dtype() {
                DType::I64 => write_back(output, self.scatter_sum::<i64>(input, n)?),
                DType::U32 => write_back(output, self.scatter_sum::<u32>(input, n)?),
                _ => write_back(output, self.scatter_sum::<u8>(input, n)?),
            },
            dtype => Err(unsupported(format!("{op:?} reduce-scatter of {dtype:?}"))),
        }
    }

    /// One MPI message (standard mode: MPI may buffer a small one and return, or wait for the
    /// receiver): a header of little-endian `u64`s (the dtype's code, the rank, the dimensions),
    /// then the values' bytes, exactly as they are (any dtype but the 8-bit float formats).
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        check_peer("send", dst, self.rank(), self.world_size())?;
        let message = encode(tensor)?;
        self.world.process_at_rank(dst as i32).send(&message[..]);
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        check_peer("recv", src, self.rank(), self.world_size())?;
        check_contiguous(tensor)?;
        // Always taken whole (its size probed first), so a refused message is not left behind.
        let (message, _status) = self.world.process_at_rank(src as i32).receive_vec::<u8>();
        let (dtype, dims, bytes) = decode(&message)?;
        check_received(tensor, src, dtype, &dims)?;
        write_into(tensor, &from_bytes(dtype, &dims, bytes)?)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }
}

/// The dtypes a point-to-point message carries, by their code in its header.
const P2P_DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// `values` as little-endian bytes, appended to `out`.
fn put<T: WithDType, const N: usize>(
    out: &mut Vec<u8>,
    tensor: &Tensor,
    bytes: fn(T) -> [u8; N],
) -> Result<()> {
    out.extend(host::<T>(tensor)?.into_iter().flat_map(bytes));
    Ok(())
}

/// A point-to-point message: the header (dtype code, rank, dimensions) and the values' bytes.
fn encode(tensor: &Tensor) -> Result<Vec<u8>> {
    let dtype = tensor.dtype();
    let code = P2P_DTYPES
        .iter()
        .position(|&d| d == dtype)
        .ok_or_else(|| unsupported(format!("a send of {dtype:?}")))?;
    let dims = tensor.dims();
    let mut out =
        Vec::with_capacity(8 * (2 + dims.len()) + tensor.elem_count() * dtype.size_in_bytes());
    for word in [code, dims.len()].into_iter().chain(dims.iter().copied()) {
        out.extend((word as u64).to_le_bytes());
    }
    match dtype {
        DType::U8 => put::<u8, 1>(&mut out, tensor, |x| [x]),
        DType::U32 => put::<u32, 4>(&mut out, tensor, u32::to_le_bytes),
        DType::I64 => put::<i64, 8>(&mut out, tensor, i64::to_le_bytes),
        DType::BF16 => put::<half::bf16, 2>(&mut out, tensor, half::bf16::to_le_bytes),
        DType::F16 => put::<half::f16, 2>(&mut out, tensor, half::f16::to_le_bytes),
        DType::F32 => put::<f32, 4>(&mut out, tensor, f32::to_le_bytes),
        _ => put::<f64, 8>(&mut out, tensor, f64::to_le_bytes),
    }?;
    Ok(out)
}

/// The header and payload of a message [`encode`] made.
fn decode(message: &[u8]) -> Result<(DType, Vec<usize>, &[u8])> {
    let corrupt = || backend("a point-to-point message without its header (not sent by `send`)");
    let word = |i: usize| -> Result<usize> {
        let bytes = message.get(8 * i..8 * (i + 1)).ok_or_else(corrupt)?;
        Ok(u64::from_le_bytes(bytes.try_into().expect("8 bytes")) as usize)
    };
    let dtype = *P2P_DTYPES.get(word(0)?).ok_or_else(corrupt)?;
    let rank = word(1)?;
    let dims = (0..rank).map(|i| word(2 + i)).collect::<Result<Vec<_>>>()?;
    let payload = &message[8 * (2 + rank)..];
    let count: usize = dims.iter().product();
    if payload.len() != count * dtype.size_in_bytes() {
        return Err(corrupt());
    }
    Ok((dtype, dims, payload))
}

/// The values of a message's payload as a tensor of `dims`.
fn from_bytes(dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor> {
    fn values<T: WithDType, const N: usize>(
        bytes: &[u8],
        dims: &[usize],
        read: fn([u8; N]) -> T,
    ) -> Result<Tensor> {
        let v: Vec<T> = bytes
            .chunks_exact(N)
            .map(|c| read(c.try_into().expect("N bytes")))
            .collect();
        Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
    }
    match dtype {
        DType::U8 => values::<u8, 1>(bytes, dims, |[x]| x),
        DType::U32 => values::<u32, 4>(bytes, dims, u32::from_le_bytes),
        DType::I64 => values::<i64, 8>(bytes, dims, i64::from_le_bytes),
        DType::BF16 => values::<half::bf16, 2>(bytes, dims, half::bf16::from_le_bytes),
        DType::F16 => values::<half::f16, 2>(bytes, dims, half::f16::from_le_bytes),
        DType::F32 => values::<f32, 4>(bytes, dims, f32::from_le_bytes),
        _ => values::<f64, 8>(bytes, dims, f64::from_le_bytes),
    }
}
