//! The pipeline schedules: which micro-batch each stage runs forward or backward when, and the
//! step that runs them (activations sent forward, their gradients back, the stage's parameter
//! gradients accumulated over the micro-batches).

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId, Var};

use super::{split_error, PipelineStage};
use crate::{DistributedError, Result};

/// The loss on the last stage: the model's output for one micro-batch and its targets, to a
/// scalar.
type LossFn<'s> = Box<dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + 's>;

/// What one pipeline step leaves on a rank.
#[derive(Debug)]
pub struct PipelineStep {
    /// The gradients of this stage's parameters: each micro-batch's, summed in micro-batch order,
    /// divided by the number of micro-batches (PyTorch's `scale_grads=True`), so with a mean loss
    /// they are the gradients of the whole batch's mean loss. Step this rank's optimizer with
    /// them.
    pub grads: GradStore,
    /// The last stage's loss of each micro-batch, in order (PyTorch's `losses` list); empty on
    /// the other stages.
    pub losses: Vec<Tensor>,
    /// The last stage's output for the whole batch (the micro-batches' outputs concatenated,
    /// detached); `None` on the other stages.
    pub output: Option<Tensor>,
}

/// One action of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// The forward of a micro-batch; `defer_send`: its output is sent after the next
    /// backward's gradient is received, not at once (1F1B's steady state, so that two
    /// neighbours never both send at once).
    Forward { mb: usize, defer_send: bool },
    /// The backward of a micro-batch.
    Backward { mb: usize },
}

/// GPipe (PyTorch's `ScheduleGPipe`): every micro-batch's forward, then every backward, in
/// micro-batch order. A stage holds the activations of all the micro-batches at once.
///
/// Two stages as two threads of one process (`LocalGroup`; under `mpiexec` each rank is a
/// process and `init_from_env()` gives its group):
///
/// ```
/// use module_runtime::distributed::{Collective, LocalGroup, PipelineSplit, PipelineStage, ScheduleGPipe};
/// use module_runtime::optim::{AdamW, Optimizer, ParamList};
/// use module_runtime::prelude::*;
/// type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: Linear,
///     fc2: Linear,
/// }
///
/// let split = PipelineSplit::new([["fc1"], ["fc2"]])?;
/// let ranks = LocalGroup::new(2)?;
/// std::thread::scope(|s| -> AnyResult<()> {
///     let split = &split;
///     let handles: Vec<_> = ranks
///         .into_iter()
///         .map(|comm| {
///             s.spawn(move || -> AnyResult<Vec<Tensor>> {
///                 // Every rank builds the model empty and loads only its stage.
///                 let model = module_runtime::build_empty(|| -> Result<Mlp> {
///                     Ok(Mlp { fc1: Linear::new(4, 8, &Device::Cpu)?, fc2: Linear::new(8, 1, &Device::Cpu)? })
///                 })?;
///                 let stage = PipelineStage::new(&model, split, &comm, |x| match comm.rank() {
///                     0 => Ok(model.fc1.call(x)?.relu()?),
///                     _ => model.fc2.call(x),
///                 })?;
///                 let full: StateDict = [
///                     ("fc1.weight", Tensor::full(0.1f32, (8, 4), &Device::Cpu)?),
///                     ("fc1.bias", Tensor::zeros(8, DType::F32, &Device::Cpu)?),
///                     ("fc2.weight", Tensor::full(0.2f32, (1, 8), &Device::Cpu)?),
///                     ("fc2.bias", Tensor::zeros(1, DType::F32, &Device::Cpu)?),
///                 ]
///                 .into_iter()
///                 .collect();
///                 stage.load_state_dict(&full)?;
///                 let mse = |y: &Tensor, t: &Tensor| -> Result<Tensor> { Ok((y - t)?.sqr()?.mean_all()?) };
///                 let schedule = ScheduleGPipe::new(&stage, 2, mse)?; // 2 micro-batches
///                 let mut opt = AdamW::new(&ParamList(stage.named_parameters().to_vec()), AdamW::options())?;
///                 let x = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?;
///                 let y = Tensor::zeros((4, 1), DType::F32, &Device::Cpu)?;
///                 let step = schedule.step(stage.is_first().then_some(&x), stage.is_last().then_some(&y))?;
///                 opt.step(&step.grads)?; // this rank's parameters only
///                 Ok(step.losses)
///             })
///         })
///         .collect();
///     let losses: Vec<Vec<Tensor>> = handles.into_iter().map(|h| h.join().unwrap()).collect::<AnyResult<_>>()?;
///     // The last stage's loss per micro-batch: relu(4 * 0.1) summed by fc2, 8 * 0.2 * 0.4 = 0.64.
///     assert_eq!(losses[0].len(), 0);
///     let l: f32 = losses[1][0].to_scalar()?;
///     assert!((l - 0.64f32.powi(2)).abs() < 1e-6);
///     Ok(())
/// })?;
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub struct ScheduleGPipe<'s, 'a> {
    runner: Runner<'s, 'a>,
}

/// 1F1B (PyTorch's `Schedule1F1B`): stage `s` of `S` runs `min(S - s - 1, M)` forwards, then
/// alternates one forward and one backward, then runs the backwards left. A stage holds at most
/// `S - s` micro-batches' activations instead of GPipe's `M`, for the same gradients, bit for
/// bit (backwards run in micro-batch order in both).
pub struct Schedule1F1B<'s, 'a> {
    runner: Runner<'s, 'a>,
}

macro_rules! schedule_api {
    ($ty:ident, $order:path) => {
        impl<'s, 'a> $ty<'s, 'a> {
            /// The schedule of `stage` over `n_microbatches` micro-batches, with `loss_fn`
            /// (the model's output and targets of one micro-batch, to a scalar loss) on the last
            /// stage (the others never call it). No micro-batch is
            /// [`DistributedError::MicroBatches`].
            pub fn new(
                stage: &'s PipelineStage<'a>,
                n_microbatches: usize,
                loss_fn: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + 's,
            ) -> Result<Self> {
                Ok(Self {
                    runner: Runner::new(stage, n_microbatches, Box::new(loss_fn))?,
                })
            }

            /// One training step over a batch (PyTorch's `schedule.step(x)` on the first stage,
            /// `schedule.step(target=y, losses=losses)` on the last, `schedule.step()` between):
            /// the first stage takes `input`, the last `target`, both split along dimension 0
            /// into the micro-batches; the other stages' arguments are ignored. Every rank of
            /// the group must call it. The stage's gradients come back in
            /// [`PipelineStep::grads`]; nothing is stepped.
            ///
            /// Checked before anything runs, so a refused step changes nothing: a missing input
            /// or target is [`DistributedError::PipelineInput`], a batch that the micro-batch
            /// count does not divide [`DistributedError::MicroBatches`]; the ranks agree on it
            /// (one small all-reduce), so the others return [`DistributedError::PipelineInput`]
            /// instead of waiting for a step that never comes. A failure once the step
            /// runs (a forward's error) leaves the other ranks waiting, as a failed collective
            /// does; a [`LocalGroup`](crate::LocalGroup) with a timeout ends them.
            pub fn step(
                &self,
                input: Option<&Tensor>,
                target: Option<&Tensor>,
            ) -> Result<PipelineStep> {
                let s = self.runner.stage;
                self.runner.run(
                    &$order(s.stage_index(), s.num_stages(), self.runner.n),
                    input,
                    target,
                )
            }

            /// The number of micro-batches.
            pub fn n_microbatches(&self) -> usize {
                self.runner.n
            }
        }
    };
}

schedule_api!(ScheduleGPipe, gpipe_order);
schedule_api!(Schedule1F1B, one_f_one_b_order);

/// GPipe's actions: all forwards, then all backwards.
fn gpipe_order(_stage: usize, _num_stages: usize, n: usize) -> Vec<Action> {
    let forwards = (0..n).map(|mb| Action::Forward {
        mb,
        defer_send: false,
    });
    forwards
        .chain((0..n).map(|mb| Action::Backward { mb }))
        .collect()
}

/// 1F1B's actions on stage `stage` of `num_stages`: the warm-up forwards, the steady
/// forward-backward pairs, the cool-down backwards. In the steady state a forward's output is
/// sent after the pair's backward gradient is received, the order in which the next stage
/// sends that gradient and then takes the output, so blocking sends never wait on each other.
fn one_f_one_b_order(stage: usize, num_stages: usize, n: usize) -> Vec<Action> {
    let warmup = (num_stages - stage - 1).min(n);
    let mut order: Vec<Action> = (0..warmup)
        .map(|mb| Action::Forward {
            mb,
            defer_send: false,
        })
        .collect();
    for mb in 0..n - warmup {
        order.push(Action::Forward {
            mb: warmup + mb,
            defer_send: true,
        });
        order.push(Action::Backward { mb });
    }
    order.extend((n - warmup..n).map(|mb| Action::Backward { mb }));
    order
}

/// What a schedule shares: the stage, the micro-batch count, the loss.
struct Runner<'s, 'a> {
    stage: &'s PipelineStage<'a>,
    n: usize,
    loss_fn: LossFn<'s>,
}

/// One micro-batch in flight on a stage: its received input (a leaf, for its gradient), its
/// output, and on the last stage its loss.
struct InFlight {
    input: Option<Var>,
    output: Tensor,
    loss: Option<Tensor>,
}

impl<'s, 'a> Runner<'s, 'a> {
    fn new(stage: &'s PipelineStage<'a>, n: usize, loss_fn: LossFn<'s>) -> Result<Self> {
        if n == 0 {
            return Err(DistributedError::MicroBatches {
                stage: stage.stage_index(),
                what: "input",
                batch: 0,
                n_microbatches: 0,
            }
            .into());
        }
        Ok(Runner { stage, n, loss_fn })
    }

    /// `batch` split into the micro-batches, or why it cannot be.
    fn chunks(&self, batch: Option<&Tensor>, what: &'static str) -> Result<Vec<Tensor>> {
        let stage = self.stage;
        let Some(batch) = batch else {
            return Err(DistributedError::PipelineInput {
                stage: stage.stage_index(),
                num_stages: stage.num_stages(),
                reason: format!(
                    "the {} stage needs the batch's {what} (`step({})`)",
                    if what == "input" { "first" } else { "last" },
                    if what == "input" {
                        "Some(&x), ..."
                    } else {
                        "..., Some(&y)"
                    }
                ),
            }
            .into());
        };
        let rows = batch.dims().first().copied().unwrap_or(0);
        if rows == 0 || rows % self.n != 0 {
            return Err(DistributedError::MicroBatches {
                stage: stage.stage_index(),
                what,
                batch: rows,
                n_microbatches: self.n,
            }
            .into());
        }
        let size = rows / self.n;
        (0..self.n)
            .map(|k| Ok(batch.narrow(0, k * size, size)?))
            .collect()
    }

    fn run(
        &self,
        order: &[Action],
        input: Option<&Tensor>,
        target: Option<&Tensor>,
    ) -> Result<PipelineStep> {
        let stage = self.stage;
        let (first, last) = (stage.is_first(), stage.is_last());
        let checked = (|| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
            let inputs = if first {
                self.chunks(input, "input")?
            } else {
                Vec::new()
            };
            let targets = if last {
                self.chunks(target, "target")?
            } else {
                Vec::new()
            };
            Ok((inputs, targets))
        })();
        let comm = stage.comm();
        // Every rank learns whether any refused the step, so none starts one the others left.
        let refused = Tensor::new(&[u8::from(checked.is_err())], &comm.device())?;
        comm.all_reduce(&refused, crate::ReduceOp::Sum)?;
        let (inputs, targets) = checked?;
        if refused.to_vec1::<u8>()?[0] > 0 {
            return Err(DistributedError::PipelineInput {
                stage: stage.stage_index(),
                num_stages: stage.num_stages(),
                reason: "another stage refused this step's batch (its error says why); \
                         nothing ran"
                    .into(),
            }
            .into());
        }
        let (prev, next) = (stage.stage_index().wrapping_sub(1), stage.stage_index() + 1);
        let mut flight: Vec<Option<InFlight>> = (0..self.n).map(|_| None).collect();
        // The shape and dtype of the activations this stage receives (from the first
        // micro-batch's header), and a forward output waiting to be sent.
        let mut incoming: Option<(DType, Vec<usize>)> = None;
        let mut deferred: Option<usize> = None;
        let foreign = stage.foreign_params();
        // The stage's parameters' graph leaves (a frozen or unbuilt one has none) and their
        // gradients' running sums.
        let vars: Vec<Option<Var>> = stage
            .named_parameters()
            .iter()
            .map(|(_, p)| p.requires_grad().then(|| p.var().ok()).flatten())
            .collect();
        let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
        let (mut losses, mut outputs) = (Vec::new(), Vec::new());
        for &action in order {
            match action {
                Action::Forward { mb, defer_send } => {
                    let x = if first {
                        None
                    } else {
                        if incoming.is_none() {
                            incoming = Some(recv_header(comm, prev)?);
                        }
                        let (dtype, dims) = incoming.as_ref().expect("received above");
                        let buf = Tensor::zeros(dims.as_slice(), *dtype, &comm.device())?;
                        comm.recv(&buf, prev)?;
                        Some(Var::from_tensor(&buf)?)
                    };
                    let output = match &x {
                        Some(x) => stage.forward(x.as_tensor())?,
                        None => stage.forward(&inputs[mb])?,
                    };
                    let loss = if last {
                        let loss = (self.loss_fn)(&output, &targets[mb])?;
                        losses.push(loss.detach());
                        outputs.push(output.detach());
                        Some(loss)
                    } else {
                        None
                    };
                    flight[mb] = Some(InFlight {
                        input: x,
                        output,
                        loss,
                    });
                    if !last {
                        if defer_send {
                            deferred = Some(mb);
                        } else {
                            send_output(comm, &flight, mb, next)?;
                        }
                    }
                }
                Action::Backward { mb } => {
                    let done = flight[mb].take().expect("a forward before its backward");
                    let grads = if last {
                        let loss = done.loss.as_ref().expect("the last stage's loss");
                        loss.backward()?
                    } else {
                        let g = done.output.zeros_like()?;
                        comm.recv(&g, next)?;
                        if let Some(k) = deferred.take() {
                            send_output(comm, &flight, k, next)?;
                        }
                        done.output.mul(&g)?.sum_all()?.backward()?
                    };
                    if let Some(x) = &done.input {
                        let gx = match grads.get(x.as_tensor()) {
                            Some(g) => g.clone(),
                            None => x.as_tensor().zeros_like()?,
                        };
                        comm.send(&gx, prev)?;
                    }
                    self.accumulate(&mut sums, &vars, &grads, &foreign)?;
                }
            }
        }
        // PyTorch's `scale_grads`: the sums divided (not multiplied by a reciprocal) by the
        // micro-batch count.
        let mut grads = GradStore::default();
        for (var, sum) in vars.iter().zip(sums) {
            if let (Some(var), Some(sum)) = (var, sum) {
                let n = Tensor::new(self.n as f64, sum.device())?.to_dtype(sum.dtype())?;
                grads.insert(var.as_tensor(), sum.broadcast_div(&n)?);
            }
        }
        Ok(PipelineStep {
            grads,
            losses,
            output: if last {
                Some(Tensor::cat(&outputs, 0)?)
            } else {
                None
            },
        })
    }

    /// Adds one micro-batch's gradients of the stage's parameters (`vars`, in order) to the
    /// running sums, in micro-batch order.
    fn accumulate(
        &self,
        sums: &mut [Option<Tensor>],
        vars: &[Option<Var>],
        grads: &GradStore,
        foreign: &HashMap<TensorId, String>,
    ) -> Result<()> {
        let mut used: Vec<&str> = grads
            .get_ids()
            .filter_map(|id| foreign.get(id).map(String::as_str))
            .collect();
        if !used.is_empty() {
            used.sort_unstable();
            return Err(split_error(format!(
                "stage {}'s forward used `{}`, which the split puts on another stage",
                self.stage.stage_index(),
                used.join("`, `")
            )));
        }
        for (sum, var) in sums.iter_mut().zip(vars) {
            let Some(g) = var.as_ref().and_then(|v| grads.get(v.as_tensor())) else {
                continue;
            };
            *sum = Some(match sum.take() {
                Some(s) => (s + g)?,
                None => g.clone(),
            });
        }
        Ok(())
    }
}

/// The dtypes an activation may have, by their code in the header.
const ACTIVATION_DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// The most dimensions an activation may have.
const MAX_DIMS: usize = 8;

/// Sends micro-batch `mb`'s output to the next stage, after its header on the first one.
fn send_output(
    comm: &dyn crate::Collective,
    flight: &[Option<InFlight>],
    mb: usize,
    next: usize,
) -> Result<()> {
    let output = &flight[mb].as_ref().expect("a micro-batch in flight").output;
    if mb == 0 {
        send_header(comm, output, next)?;
    }
    comm.send(output, next)
}

/// The shape inference PyTorch's stages run at the first step, at every step: the receiver
/// learns the activations' dtype and shape (`[code, rank, dims.., 0..]`, `MAX_DIMS + 2` `i64`s).
fn send_header(comm: &dyn crate::Collective, output: &Tensor, next: usize) -> Result<()> {
    let dtype = output.dtype();
    let code = ACTIVATION_DTYPES.iter().position(|&d| d == dtype);
    let (Some(code), true) = (code, output.rank() <= MAX_DIMS) else {
        return Err(DistributedError::PipelineInput {
            stage: comm.rank(),
            num_stages: comm.world_size(),
            reason: format!(
                "the stage's output is a {dtype:?} tensor of shape {:?}: a pipeline sends \
                 floating-point activations of at most {MAX_DIMS} dimensions",
                output.dims()
            ),
        }
        .into());
    };
    let mut header = vec![code as i64, output.rank() as i64];
    header.extend(output.dims().iter().map(|&d| d as i64));
    header.resize(MAX_DIMS + 2, 0);
    comm.send(&Tensor::new(header, &comm.device())?, next)
}

/// The header [`send_header`] sent.
fn recv_header(comm: &dyn crate::Collective, prev: usize) -> Result<(DType, Vec<usize>)> {
    let header = Tensor::zeros(MAX_DIMS + 2, DType::I64, &comm.device())?;
    comm.recv(&header, prev)?;
    let h: Vec<i64> = header.to_vec1()?;
    let dtype = ACTIVATION_DTYPES[h[0] as usize];
    Ok((
        dtype,
        h[2..2 + h[1] as usize]
            .iter()
            .map(|&d| d as usize)
            .collect(),
    ))
}
