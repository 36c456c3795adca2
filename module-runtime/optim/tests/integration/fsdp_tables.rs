//! `FullyShardedDataParallel` with embedding tables: an `Embedding` looks its rows up through
//! the sharded table (`Param::scoped_rows`), so its backward sends the rows' gradient to the
//! shard without gathering the table again. A table tied to the output projection (read whole
//! there, looked up by the embedding) stays in the root unit. Both train as data parallelism:
//! bitwise for a table of its own, within float32 rounding for the tied one (its two gradients
//! are averaged over the ranks one after the other, data parallelism averages their sum).

use std::cell::Cell;
use std::rc::Rc;

use module_runtime::distributed::{
    Collective, DdpConfig, DistributedDataParallel, LocalGroup, ReduceOp,
};
use module_runtime::nn::Embedding;
use module_runtime::optim::{AdamW, FsdpConfig, FullyShardedDataParallel, Optimizer};
use module_runtime::prelude::*;
use module_runtime::StateDict;

const VOCAB: usize = 11;
const DIM: usize = 6;

#[derive(Module)]
struct Block {
    fc: Linear,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok((x + self.fc.call(x)?.tanh()?)?)
    }
}

/// Token ids → logits over the vocabulary, the head tied to the table (`tied`) or its own.
#[derive(Module)]
struct Lm {
    embed: Embedding,
    blocks: Vec<Block>,
    head: Option<Linear>,
}

impl Forward<&Tensor> for Lm {
    type Output = Tensor;
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut h = self.embed.call(ids)?;
        for b in &self.blocks {
            h = b.call(&h)?;
        }
        match &self.head {
            Some(head) => head.call(&h),
            None => Ok(h.broadcast_matmul(&self.embed.weight.tensor()?.t()?)?),
        }
    }
}

/// The same model on every call with `seed` 0; ranks seeded differently take rank 0's values.
fn lm(tied: bool, seed: usize) -> Lm {
    let dev = Device::Cpu;
    let m = Lm {
        embed: Embedding::new(VOCAB, DIM, &dev).unwrap(),
        blocks: (0..2)
            .map(|_| Block {
                fc: Linear::new(DIM, DIM, &dev).unwrap(),
            })
            .collect(),
        head: (!tied).then(|| Linear::new(DIM, VOCAB, &dev).unwrap()),
    };
    for (i, (_, p)) in m.named_parameters().into_iter().enumerate() {
        let v: Vec<f32> = (0..p.elem_count())
            .map(|k| (((k + 11 * i + seed) * 37) % 23) as f32 / 23.0 - 0.5)
            .collect();
        p.set(&Tensor::from_vec(v, p.shape(), &dev).unwrap())
            .unwrap();
    }
    m
}

/// Step `k`'s ids and targets on `rank` (ids repeat, so rows' gradients add up).
fn batch(k: usize, rank: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..9)
        .map(|i| ((i * 5 + k * 3 + rank * 7) % VOCAB) as u32)
        .collect();
    let targets: Vec<u32> = ids.iter().map(|&i| (i + 1) % VOCAB as u32).collect();
    (
        Tensor::from_vec(ids, (3, 3), &Device::Cpu).unwrap(),
        Tensor::new(targets.as_slice(), &Device::Cpu).unwrap(),
    )
}

fn loss(logits: Tensor, targets: &Tensor) -> Tensor {
    let logits = logits.reshape(((), VOCAB)).unwrap();
    module_runtime::candle_nn::loss::cross_entropy(&logits, targets).unwrap()
}

/// Runs `f` on every rank of a `world`-rank `LocalGroup`, each in its own thread.
fn on_ranks<T: Send>(world: usize, f: impl Fn(LocalGroup) -> T + Sync) -> Vec<T> {
    let ranks = LocalGroup::new(world).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn ddp_run(tied: bool, comm: &LocalGroup) -> StateDict {
    let model = lm(tied, comm.rank());
    let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default()).unwrap();
    let mut opt = AdamW::new(&model, AdamW::options().lr(5e-2)).unwrap();
    for k in 0..4 {
        let (ids, y) = batch(k, comm.rank());
        let mut g = loss(ddp.call(&ids).unwrap(), &y).backward().unwrap();
        ddp.reduce_gradients(&mut g).unwrap();
        opt.step(&g).unwrap();
    }
    model.state_dict().unwrap()
}

/// A process group that counts the elements every all-gather fills.
struct Counting {
    inner: LocalGroup,
    gathered: Cell<usize>,
}

impl Collective for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        "counting"
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> module_runtime::Result<()> {
        self.inner.all_reduce(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> module_runtime::Result<()> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> module_runtime::Result<()> {
        self.inner.barrier()
    }
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> module_runtime::Result<()> {
        self.gathered.set(self.gathered.get() + output.elem_count());
        self.inner.all_gather(input, output)
    }
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> module_runtime::Result<()> {
        self.inner.reduce_scatter(input, output, op)
    }
}

/// The same 4 steps sharded, with the table a unit of its own when untied (`embed` and
/// `blocks.*`) and in the root when tied: the full state dict, and the elements all-gathered in
/// each step's backward.
fn fsdp_run(tied: bool, comm: LocalGroup) -> (StateDict, Vec<usize>) {
    let rank = comm.rank();
    let counting = Rc::new(Counting {
        inner: comm,
        gathered: Cell::new(0),
    });
    let comm: Rc<dyn Collective> = counting.clone();
    let units = if tied {
        vec!["blocks.*"]
    } else {
        vec!["embed", "blocks.*"]
    };
    let config = FsdpConfig::default().auto_wrap_policy(units);
    let fsdp = FullyShardedDataParallel::new(lm(tied, rank), comm, config).unwrap();
    let mut opt = AdamW::new(fsdp.module(), AdamW::options().lr(5e-2)).unwrap();
    let mut in_backward = Vec::new();
    for k in 0..4 {
        let (ids, y) = batch(k, rank);
        let loss = loss(fsdp.call(&ids).unwrap(), &y);
        let before = counting.gathered.get();
        let g = loss.backward().unwrap();
        in_backward.push(counting.gathered.get() - before);
        opt.step(&g).unwrap();
    }
    (fsdp.state_dict().unwrap(), in_backward)
}

fn max_diff(a: &StateDict, b: &StateDict) -> f64 {
    let mut worst = 0.0f64;
    for (k, t) in a.iter() {
        let u = b.get(k).unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(t.dims(), u.dims(), "{k}");
        let d = (t - u).unwrap().abs().unwrap().flatten_all().unwrap();
        worst = worst.max(d.max(0).unwrap().to_scalar::<f32>().unwrap() as f64);
    }
    assert_eq!(a.len(), b.len());
    worst
}

#[test]
fn a_table_of_its_own_trains_bitwise_and_is_not_gathered_for_the_backward() {
    for world in [2, 3] {
        let ddp = on_ranks(world, |c| ddp_run(false, &c));
        for (r, (model, in_backward)) in on_ranks(world, |c| fsdp_run(false, c)).iter().enumerate()
        {
            assert_eq!(max_diff(model, &ddp[0]), 0.0, "world {world}, rank {r}");
            // The backward gathers the blocks' weights and biases again, never the table.
            let chunk = |n: usize| n.div_ceil(world) * world;
            let blocks = 2 * (chunk(DIM * DIM) + chunk(DIM));
            assert_eq!(in_backward, &vec![blocks; 4], "world {world}, rank {r}");
        }
    }
}

#[test]
fn a_tied_table_trains_as_data_parallelism_within_rounding() {
    for world in [2, 3] {
        let ddp = on_ranks(world, |c| ddp_run(true, &c));
        for (r, (model, _)) in on_ranks(world, |c| fsdp_run(true, c)).iter().enumerate() {
            let diff = max_diff(model, &ddp[0]);
            assert!(diff < 1e-6, "world {world}, rank {r}: {diff}");
        }
    }
}

#[test]
fn lookups_without_gradients_match_the_unwrapped_model() {
    let reference = lm(true, 0);
    let (ids, _) = batch(0, 0);
    let expected = reference.call(&ids).unwrap();
    let outs = on_ranks(2, |c| {
        let comm: Rc<dyn Collective> = Rc::new(c);
        let config = FsdpConfig::default().auto_wrap_policy(["embed", "blocks.*"]);
        let fsdp = FullyShardedDataParallel::new(lm(false, 0), comm.clone(), config).unwrap();
        let untied = {
            let _no_grad = no_grad();
            fsdp.call(&ids).unwrap()
        };
        let plain = lm(false, 0).call(&ids).unwrap();
        let tied = FullyShardedDataParallel::new(lm(true, 0), comm, FsdpConfig::default())
            .unwrap()
            .call(&ids)
            .unwrap();
        (untied, plain, tied)
    });
    for (untied, plain, tied) in outs {
        assert!(!untied.track_op(), "no graph under no_grad");
        let d = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(d(&untied, &plain), 0.0);
        assert_eq!(d(&tied, &expected), 0.0);
    }
}
