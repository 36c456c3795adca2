//! Pipeline parallelism (PyTorch's `torch.distributed.pipelining`): a model's layers split over
//! the ranks by path ([`PipelineSplit`]), each rank running its stage ([`PipelineStage`]) on
//! micro-batches under a schedule ([`ScheduleGPipe`], [`Schedule1F1B`]), activations sent
//! forward and their gradients back with the engine's [`send`](Collective::send) and
//! [`recv`](Collective::recv).

mod schedule;

use std::collections::{HashMap, HashSet};

use candle_core::{Tensor, TensorId};
use module_state::state::{slots, Slot};

use super::{Collective, DistributedError};
use crate::{
    Error, LoadOptions, LoadReport, Module, ModuleExt, Param, PathPattern, Result, StateDict,
};

pub use schedule::{PipelineStep, Schedule1F1B, ScheduleGPipe};

/// Which parts of a model each pipeline stage holds: one list of module paths (or
/// [`PathPattern`]s: `layers.*`) per stage, stage `i` on rank `i`. PyTorch's manual split, where
/// each rank keeps the model's own submodules for its stage, so their paths (and state-dict keys)
/// stay the model's.
///
/// A pattern selects the parameters and persistent buffers at or below the paths it matches.
/// [`PipelineStage::new`] checks the split against the model: every parameter and buffer must
/// be in exactly one stage, every pattern must match something, and a parameter shared by two
/// paths (a tied embedding) must not be split over two stages (PyTorch's pipelining has no tied
/// weights across stages either); anything else is [`DistributedError::StageSplit`] naming the
/// paths.
///
/// ```
/// use module_runtime::distributed::PipelineSplit;
/// let split = PipelineSplit::new([vec!["embed", "layers.0", "layers.1"], vec!["layers.2", "layers.3", "head"]])?;
/// assert_eq!(split.num_stages(), 2);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineSplit {
    stages: Vec<Vec<PathPattern>>,
}

impl PipelineSplit {
    /// A split with one list of module paths or patterns per stage, in stage order. An invalid
    /// pattern is [`Error::InvalidPattern`]; no stage, or a stage with no pattern, is
    /// [`DistributedError::StageSplit`].
    pub fn new<I, S, P>(stages: I) -> Result<PipelineSplit>
    where
        I: IntoIterator<Item = S>,
        S: IntoIterator<Item = P>,
        P: AsRef<str>,
    {
        let stages = stages
            .into_iter()
            .map(|s| {
                s.into_iter()
                    .map(|p| PathPattern::new(p.as_ref()))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        if stages.is_empty() {
            return Err(split_error("it has no stage".into()));
        }
        if let Some(i) = stages.iter().position(Vec::is_empty) {
            return Err(split_error(format!("stage {i} has no path")));
        }
        Ok(PipelineSplit { stages })
    }

    /// The number of stages.
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// The paths of `model`'s parameters and persistent buffers (every alias of a tied one), each
    /// with its stage, in state-dict order; or the first problem found, with every path it
    /// concerns.
    pub fn assign(&self, model: &dyn Module) -> Result<Vec<(String, usize)>> {
        let all = slots(model);
        let mut out = Vec::with_capacity(all.len());
        let (mut uncovered, mut twice) = (Vec::new(), Vec::new());
        let mut used: Vec<Vec<bool>> = self.stages.iter().map(|s| vec![false; s.len()]).collect();
        for (path, _) in &all {
            let mut found = Vec::new();
            for (stage, patterns) in self.stages.iter().enumerate() {
                for (j, pattern) in patterns.iter().enumerate() {
                    if pattern.matches_at_or_above(path) {
                        used[stage][j] = true;
                        if !found.contains(&stage) {
                            found.push(stage);
                        }
                    }
                }
            }
            match found[..] {
                [] => uncovered.push(path.clone()),
                [stage] => out.push((path.clone(), stage)),
                _ => twice.push(format!("`{path}` in stages {found:?}")),
            }
        }
        let unmatched: Vec<String> = self
            .stages
            .iter()
            .enumerate()
            .flat_map(|(stage, patterns)| {
                let used = &used[stage];
                patterns
                    .iter()
                    .zip(used)
                    .filter(|(_, u)| !**u)
                    .map(move |(p, _)| format!("`{}` (stage {stage})", p.as_str()))
            })
            .collect();
        let mut problems = Vec::new();
        if !uncovered.is_empty() {
            problems.push(format!("in no stage: {}", quoted(&uncovered)));
        }
        if !twice.is_empty() {
            problems.push(format!("in two stages: {}", twice.join(", ")));
        }
        if !unmatched.is_empty() {
            problems.push(format!(
                "matching no parameter or buffer: {}",
                unmatched.join(", ")
            ));
        }
        // A tensor shared by paths of two stages would get two gradients and two updates.
        let mut owner: HashMap<usize, (String, usize)> = HashMap::new();
        for ((path, slot), (_, stage)) in all.iter().zip(&out) {
            if let Slot::Param(p) = slot {
                match owner.get(&p.id()) {
                    Some((first, s)) if s != stage => problems.push(format!(
                        "`{first}` (stage {s}) and `{path}` (stage {stage}) are one tied \
                         parameter: keep them in one stage"
                    )),
                    Some(_) => {}
                    None => {
                        owner.insert(p.id(), (path.clone(), *stage));
                    }
                }
            }
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(split_error(problems.join("; ")))
        }
    }
}

fn quoted(paths: &[String]) -> String {
    paths
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn split_error(reason: String) -> Error {
    DistributedError::StageSplit { reason }.into()
}

/// The stage's forward: the model's parts on this rank, from its input (the batch on the first
/// stage, the previous stage's output on the others) to its output (the model's output on the
/// last stage).
type StageForward<'a> = Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>;

/// One rank's stage of a pipeline (PyTorch's `PipelineStage(submodule, stage_index, num_stages,
/// device)`): the model's parameters and buffers that a [`PipelineSplit`] gives to this rank
/// (stage `comm.rank()` of `comm.world_size()`), and the stage's forward, a closure over those
/// modules.
///
/// **The model on each rank.** Every rank builds the same model; to hold only its stage's
/// weights, it builds it empty ([`build_empty`](module_core::build_empty): nothing allocated, PyTorch's
/// meta device) and loads its stage's part with [`load_state_dict`](Self::load_state_dict), so
/// the other stages' parameters are **never built** (reading one is
/// [`Error::NotLoaded`]). A model built whole on every rank also works (small models, tests):
/// the stage then simply leaves the other parameters alone. Either way the paths are the
/// model's own: [`state_dict`](Self::state_dict) is this stage's part of the model's state dict,
/// and the union over the ranks is the single-process state dict.
///
/// **The forward** is written by the user, as PyTorch's manual stages are (a stage module whose
/// forward skips what it does not hold): it takes the stage's input and runs the stage's modules,
/// for instance `embed` and `layers[0..2]` on stage 0, `layers[2..4]` and `head` on stage 1.
/// A forward that reads a parameter of another stage is an error at the first step
/// ([`Error::NotLoaded`] when it was never built, [`DistributedError::StageSplit`] naming it when
/// it was), never a silently dropped gradient.
///
/// One stage per rank (PyTorch's interleaved schedules, with several stages per rank, are not
/// implemented); the stages exchange activations with the group's [`send`](Collective::send)
/// and [`recv`](Collective::recv).
pub struct PipelineStage<'a> {
    comm: &'a dyn Collective,
    model: &'a dyn Module,
    index: usize,
    num_stages: usize,
    /// The stage's paths, in state-dict order.
    paths: Vec<String>,
    /// The stage's parameters (each once), by path.
    params: Vec<(String, Param)>,
    forward: StageForward<'a>,
}

impl std::fmt::Debug for PipelineStage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineStage")
            .field("stage_index", &self.index)
            .field("num_stages", &self.num_stages)
            .field("paths", &self.paths)
            .finish()
    }
}

impl<'a> PipelineStage<'a> {
    /// This rank's stage of `model` under `split`, running `forward`. The split must have
    /// `comm.world_size()` stages and fit the model ([`PipelineSplit::assign`]); otherwise
    /// [`DistributedError::StageSplit`], and nothing is changed.
    pub fn new<M: Module>(
        model: &'a M,
        split: &PipelineSplit,
        comm: &'a dyn Collective,
        forward: impl Fn(&Tensor) -> Result<Tensor> + 'a,
    ) -> Result<PipelineStage<'a>> {
        let (index, num_stages) = (comm.rank(), comm.world_size());
        if split.num_stages() != num_stages {
            return Err(split_error(format!(
                "{} stages for a group of {num_stages} ranks (one stage per rank)",
                split.num_stages()
            )));
        }
        let paths: Vec<String> = split
            .assign(model)?
            .into_iter()
            .filter(|(_, stage)| *stage == index)
            .map(|(path, _)| path)
            .collect();
        let mine: HashSet<&str> = paths.iter().map(String::as_str).collect();
        let params = model
            .named_parameters()
            .into_iter()
            .filter(|(path, _)| mine.contains(path.as_str()))
            .collect();
        Ok(PipelineStage {
            comm,
            model,
            index,
            num_stages,
            paths,
            params,
            forward: Box::new(forward),
        })
    }

    /// This stage's index (the rank).
    pub fn stage_index(&self) -> usize {
        self.index
    }

    /// The number of stages (the world size).
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Whether this is the first stage, which takes the batch.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether this is the last stage, which computes the loss.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.num_stages
    }

    /// The process group.
    pub fn comm(&self) -> &'a dyn Collective {
        self.comm
    }

    /// The paths of this stage's parameters and persistent buffers (the model's own), in
    /// state-dict order.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }

    /// This stage's parameters by path (a tied one once): what its optimizer steps.
    pub fn named_parameters(&self) -> &[(String, Param)] {
        &self.params
    }

    /// This stage's part of the model's state dict: its parameters and persistent buffers under
    /// the model's paths. The union of every rank's is the model's state dict (module extra
    /// state aside). Fails with [`Error::NotLoaded`] if one of them was never loaded.
    pub fn state_dict(&self) -> Result<StateDict> {
        let mine: HashSet<&str> = self.paths.iter().map(String::as_str).collect();
        let mut sd = StateDict::new();
        for (path, slot) in slots(self.model) {
            if mine.contains(path.as_str()) {
                let value = match slot {
                    Slot::Param(p) => p.own_tensor()?,
                    Slot::Buffer(b) => b.tensor()?.detach(),
                };
                sd.insert(path, value);
            }
        }
        Ok(sd)
    }

    /// Loads this stage's part of `state` (a full state dict, or any that holds every path of
    /// the stage; other keys are ignored): PyTorch's `load_state_dict` on the stage's module.
    /// Every path of the stage must be there, with its shape and dtype, or nothing is loaded
    /// ([`Error::Load`] listing what is missing or mismatched). Unbuilt parameters (a model built
    /// with [`build_empty`](module_core::build_empty)) are built from the values; the other stages'
    /// stay unbuilt.
    pub fn load_state_dict(&self, state: &StateDict) -> Result<LoadReport> {
        let missing: Vec<String> = self
            .paths
            .iter()
            .filter(|p| state.get(p).is_none())
            .cloned()
            .collect();
        if !missing.is_empty() {
            return Err(Error::Load(Box::new(LoadReport {
                missing,
                ..LoadReport::default()
            })));
        }
        let part: StateDict = self
            .paths
            .iter()
            .filter_map(|p| state.get(p).map(|t| (p.clone(), t.clone())))
            .collect();
        // Non-strict only for the other stages' paths: every one of this stage's is in `part`.
        // A refused load reports this stage's paths only.
        let mine: HashSet<&str> = self.paths.iter().map(String::as_str).collect();
        let only_mine = |mut report: LoadReport| {
            report.missing.retain(|p| mine.contains(p.as_str()));
            report
                .suggestions
                .retain(|(m, _)| mine.contains(m.as_str()));
            report.key_fix = None;
            report
        };
        match self
            .model
            .load_state_dict(&part, &LoadOptions::default().non_strict())
        {
            Ok(report) => Ok(only_mine(report)),
            Err(Error::Load(report)) => Err(Error::Load(Box::new(only_mine(*report)))),
            Err(e) => Err(e),
        }
    }

    /// Runs the stage's forward on `input`.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (self.forward)(input)
    }

    /// Every model parameter outside this stage, by its tensor's id (those that are built).
    fn foreign_params(&self) -> HashMap<TensorId, String> {
        let mine: HashSet<usize> = self.params.iter().map(|(_, p)| p.id()).collect();
        self.model
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| !mine.contains(&p.id()) && p.is_built())
            .filter_map(|(path, p)| Some((p.var().ok()?.as_tensor().id(), path)))
            .collect()
    }
}
