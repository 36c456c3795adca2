//! The crate's error type.

use candle_core::Shape;

/// Everything that can go wrong in `module-optim`.
///
/// Variants about a parameter name its path (PyTorch-style dotted path); those about a parameter
/// group name the pattern that selected it; those about a state dict name the key.
///
/// `{:?}` (what `main` and `unwrap` print) is the message and its causes, as the runtime's
/// `Error` prints ([`module_core::error::fmt_debug`]), not a struct dump.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from a candle operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// An error from `module-runtime` (an invalid pattern, reading a checkpoint, …).
    #[error(transparent)]
    Runtime(#[from] module_core::Error),

    /// A parameter group's pattern matches no parameter of the model. A pattern matches whole
    /// paths from the root (`bias` is a parameter named `bias` at the root), not a substring as
    /// PyTorch code's `"bias" in name` does: where `**.<pattern>` would match, it is suggested.
    #[error(
        "the parameter group pattern `{pattern}` matches no parameter{}",
        pattern_fix(.pattern, .suggestion, .available)
    )]
    PatternMatchesNothing {
        /// The pattern as written.
        pattern: String,
        /// A few of the parameter paths there are, to compare with.
        available: Vec<String>,
        /// `**.<pattern>`, when it matches parameters (`**.bias` for `bias`).
        suggestion: Option<String>,
    },

    /// A parameter is selected by the patterns of two parameter groups.
    #[error(
        "parameter `{path}` is in two parameter groups: group {first_group} (pattern `{first}`) and \
         group {second_group} (pattern `{second}`)"
    )]
    ParamInTwoGroups {
        /// The parameter's path.
        path: String,
        /// The index of the first group that selects it.
        first_group: usize,
        /// The pattern of that group that matches it.
        first: String,
        /// The index of the second group that selects it.
        second_group: usize,
        /// The pattern of that group that matches it.
        second: String,
    },

    /// One parameter is listed under two paths (in a hand-made
    /// [`ParamList`](crate::ParamList); a model's `named_parameters()` lists a tied weight once).
    #[error(
        "parameter `{path}` is the same parameter as `{first}`: an optimizer must see it once"
    )]
    DuplicateParam {
        /// The later path.
        path: String,
        /// The first path it was listed under.
        first: String,
    },

    /// The optimizer would train no parameter at all (PyTorch: "optimizer got an empty parameter
    /// list"): the model has none, or all are frozen.
    #[error("the optimizer got no trainable parameter (the model has none, or all are frozen)")]
    NoParameters,

    /// The model has parameters that are not built yet (lazy, or made under `empty_weights` and
    /// not loaded): build or load the model before making its optimizer.
    #[error("cannot make an optimizer over unbuilt parameters: {}", .paths.join(", "))]
    Unbuilt {
        /// The unbuilt parameters' paths.
        paths: Vec<String>,
    },

    /// A hyperparameter is out of its range (PyTorch's checks: `lr >= 0`, `0 <= beta < 1`, …).
    #[error("invalid {name} {value}: {reason}{}", group_note(*.group))]
    InvalidHyperparameter {
        /// The hyperparameter (`lr`, `betas.0`, `momentum`, …).
        name: &'static str,
        /// The value given.
        value: f64,
        /// What it must be.
        reason: &'static str,
        /// The parameter group it was given for, if not the optimizer's defaults.
        group: Option<usize>,
    },

    /// A parameter group sets an option the optimizer does not have (`betas` on `SGD`).
    #[error("{optimizer} has no `{option}` option (set in parameter group {group})")]
    NotApplicable {
        /// The option.
        option: &'static str,
        /// The optimizer.
        optimizer: &'static str,
        /// The group that sets it.
        group: usize,
    },

    /// `clip_grad_norm` with `error_if_nonfinite`: the total norm of the gradients is `nan` or
    /// infinite.
    #[error(
        "the total norm of order {norm_type} of the gradients is non-finite ({total}), so they \
         cannot be clipped (pass error_if_nonfinite = false to scale them anyway)"
    )]
    NonFiniteNorm {
        /// The total norm.
        total: f64,
        /// The order of the norm.
        norm_type: f64,
    },

    /// A [`TrainingCheckpoint`](crate::TrainingCheckpoint) could not be saved or restored:
    /// `part` names what failed (`model`, `optimizer`, `scheduler_1`, `trainer_state`,
    /// `rng_state`, `parts` when the file holds other parts than the checkpoint, `file` when it
    /// cannot be read). A failed restore changed nothing.
    #[error(
        "training checkpoint `{}`, {part}: {source}{}",
        path.display(),
        if *.restoring { "; nothing was restored (the model, optimizers, schedules and generator are as they were)" } else { "" }
    )]
    Checkpoint {
        /// The checkpoint file.
        path: std::path::PathBuf,
        /// The part that failed.
        part: String,
        /// Whether it failed restoring (else saving).
        restoring: bool,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },

    /// `load_state_dict`: the state dict does not fit the optimizer. Nothing was changed. The
    /// message ends with what to do where the problems say it: make the optimizer with the saved
    /// run's parameter groups, over the model it was saved from, or as the same kind of optimizer.
    #[error("cannot load the optimizer state: {}{}", .0, state_hint(.0))]
    State(#[from] StateError),

    /// [`AveragedModel::update_parameters`](crate::swa_utils::AveragedModel::update_parameters):
    /// the model does not have the averaged copy's parameters or buffers, or an averaging function
    /// returned values that do not fit. Nothing was changed.
    #[error("cannot average `{path}` into the AveragedModel: {reason}")]
    AveragedModelMismatch {
        /// The path of the parameter or buffer in the model (`fc1.weight`).
        path: String,
        /// What differs.
        reason: String,
    },

    /// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer): the ranks' optimizers do
    /// not train the same parameters (paths, shapes, dtypes, groups) on every rank, so they
    /// cannot agree on who owns which; or a rank's sharded state was loaded on another rank.
    /// Raised on every rank, before anything is changed.
    #[error("ZeroRedundancyOptimizer on rank {rank}: {reason}")]
    ZeroMismatch {
        /// This rank.
        rank: usize,
        /// What differs.
        reason: String,
    },

    /// A model [`FullyShardedDataParallel`](crate::FullyShardedDataParallel) cannot shard as
    /// asked (a parameter off the CPU, one tied across two units, a wrap pattern that matches no
    /// module), or a sharded state dict of another rank. Nothing was changed.
    #[error("FullyShardedDataParallel on rank {rank}: `{path}` {reason}")]
    ShardedModel {
        /// This rank.
        rank: usize,
        /// The parameter, pattern or key concerned.
        path: String,
        /// What is wrong, and the fix.
        reason: String,
    },

    /// A [`GradScaler`](crate::GradScaler) used out of PyTorch's order (`scale`, `unscale_`,
    /// `step`, `update`), or on gradients it does not take. Nothing was changed.
    #[error("GradScaler: {reason}")]
    GradScaler {
        /// What went wrong, in PyTorch's words where PyTorch has them.
        reason: String,
    },
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        module_core::error::fmt_debug(self, f)
    }
}

/// Why an optimizer state dict does not fit the optimizer it is loaded into.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The state dict has keys the optimizer does not know (a parameter it does not train, a
    /// state entry of another optimizer, a group it does not have).
    #[error("unexpected keys: {}", list(.keys))]
    UnexpectedKeys {
        /// The keys, in the state dict's order.
        keys: Vec<String>,
    },
    /// The state dict lacks keys the optimizer needs.
    #[error("missing keys: {}", list(.keys))]
    MissingKeys {
        /// The keys.
        keys: Vec<String>,
    },
    /// The state dict has another number of parameter groups.
    #[error("the state dict has {found} parameter groups, the optimizer {expected}")]
    GroupCount {
        /// The optimizer's number of groups.
        expected: usize,
        /// The state dict's.
        found: usize,
    },
    /// A parameter group of a PyTorch optimizer state lists another number of parameters than
    /// the optimizer's group of the same index: they were not made alike.
    #[error(
        "parameter group {group} of the PyTorch state lists {found} parameters, the optimizer's \
         {expected}: make the optimizer with the same groups, in the same order, as in PyTorch"
    )]
    ParamCount {
        /// The group's index.
        group: usize,
        /// The number of parameters in the optimizer's group.
        expected: usize,
        /// The number the PyTorch state lists.
        found: usize,
    },
    /// What was read as a PyTorch optimizer state has no `state` and `param_groups`.
    #[error(
        "not a torch.optim state dict (no `state` and `param_groups`): found {found}{}",
        candidates_note(.candidates)
    )]
    NotAnOptimizerState {
        /// What was found, in words.
        found: String,
        /// The file's top-level keys that hold an optimizer state dict.
        candidates: Vec<String>,
    },
    /// A parameter is in another group in the state dict than in the optimizer.
    #[error("parameter `{path}` is in group {found} in the state dict, in group {expected} in the optimizer")]
    GroupMismatch {
        /// The parameter's path.
        path: String,
        /// Its group in the optimizer.
        expected: usize,
        /// Its group in the state dict.
        found: usize,
    },
    /// A state tensor has another shape than its parameter.
    #[error("`{key}` has shape {found:?}, its parameter {expected:?}")]
    ShapeMismatch {
        /// The state dict key.
        key: String,
        /// The parameter's shape.
        expected: Shape,
        /// The shape in the state dict.
        found: Shape,
    },
    /// A value is not one the optimizer can take (a negative step count, a hyperparameter out of
    /// range, a scalar that is not 0-dimensional).
    #[error("`{key}`: {reason}")]
    InvalidValue {
        /// The state dict key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A learning-rate schedule's state is another kind of schedule's (PyTorch's `LinearLR`
    /// state loaded into a [`StepLr`](crate::StepLr)), told by its fields.
    #[error(
        "the state is {found}'s (fields {}), not {expected}'s: make the same schedule as the run \
         that saved it",
        if .fields.is_empty() { "none besides the common ones".to_owned() } else { .fields.join(", ") }
    )]
    SchedulerKind {
        /// PyTorch's class name of the schedule loading it (`StepLR`).
        expected: &'static str,
        /// The class the state's fields are (`LinearLR`).
        found: String,
        /// The state's fields besides `last_epoch`, `_step_count`, `_last_lr` and `base_lrs`.
        fields: Vec<String>,
    },
    /// More than one of the above: everything a load found, at once (as a model's load reports
    /// every key), one line each (missing keys together, unexpected keys together).
    #[error("{} problems:{}", .problems.len(), lines(.problems))]
    Mismatches {
        /// Each problem; none is itself `Mismatches`.
        problems: Vec<StateError>,
    },
}

/// One line per problem, the first ten.
fn lines(problems: &[StateError]) -> String {
    const SHOWN: usize = 10;
    let mut s: String = problems
        .iter()
        .take(SHOWN)
        .map(|p| format!("\n  - {p}"))
        .collect();
    if problems.len() > SHOWN {
        s.push_str(&format!("\n  - and {} more", problems.len() - SHOWN));
    }
    s
}

/// What to do, from the kinds of problems a load found.
fn state_hint(e: &StateError) -> String {
    let problems = match e {
        StateError::Mismatches { problems } => problems.as_slice(),
        one => std::slice::from_ref(one),
    };
    let keys = |p: &StateError| -> Vec<String> {
        match p {
            StateError::MissingKeys { keys } | StateError::UnexpectedKeys { keys } => keys.clone(),
            _ => Vec::new(),
        }
    };
    let all_keys: Vec<String> = problems.iter().flat_map(keys).collect();
    let mut hints = Vec::new();
    if problems.iter().any(|p| {
        matches!(
            p,
            StateError::GroupCount { .. } | StateError::GroupMismatch { .. }
        )
    }) {
        hints.push(
            "make the optimizer with the parameter groups of the run that saved the state (the \
             same `ParamGroups` patterns and options, in the same order)",
        );
    }
    if all_keys.iter().any(|k| k.starts_with("param_groups.")) {
        hints.push(
            "the state has other hyperparameters: it was saved by another kind of optimizer \
             (`SGD` into `AdamW`?) or with other options (`amsgrad`, `momentum`); make the same \
             optimizer as the run that saved it",
        );
    }
    if all_keys.iter().any(|k| k.starts_with("params.")) {
        hints.push(
            "the state's parameter paths are not this model's: load it into an optimizer over \
             the model it was saved from (a model whose paths changed needs the state dict's keys \
             renamed first)",
        );
    }
    if problems
        .iter()
        .any(|p| matches!(p, StateError::ShapeMismatch { .. }))
    {
        hints.push(
            "the parameters have other shapes than in the saved run: make the model with the \
             saved run's configuration",
        );
    }
    match hints.as_slice() {
        [] => String::new(),
        hints => format!("\nwhat to do: {}", hints.join("; ")),
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Keys as a short list: hyperparameters, then parameters, then state entries, keys that differ
/// only in their numbers as one pattern (`param_groups.{0,1}.eps`), the first ten patterns.
fn list(keys: &[String]) -> String {
    const SHOWN: usize = 10;
    let rank = |k: &str| match k.split('.').next() {
        Some("param_groups") => 0,
        Some("params") => 1,
        Some("state") => 2,
        _ => 3,
    };
    let mut sorted: Vec<&str> = keys.iter().map(String::as_str).collect();
    sorted.sort_by_key(|k| rank(k));
    let groups = module_core::key_groups::group_keys(sorted);
    let mut s = groups
        .iter()
        .take(SHOWN)
        .map(|g| format!("`{}`", g.pattern))
        .collect::<Vec<_>>()
        .join(", ");
    if groups.len() > SHOWN {
        let rest: usize = groups[SHOWN..].iter().map(|g| g.count).sum();
        s.push_str(&format!(" and {rest} more"));
    }
    s
}

fn pattern_fix(pattern: &str, suggestion: &Option<String>, available: &[String]) -> String {
    match suggestion {
        Some(s) => format!(
            ": a pattern matches whole paths from the model's root, not a part of a name as \
             `\"{pattern}\" in name` does in PyTorch; did you mean `{s}` (`{pattern}` at any \
             depth)?{}",
            list_some(available)
        ),
        None => list_some(available),
    }
}

fn list_some(available: &[String]) -> String {
    if available.is_empty() {
        String::new()
    } else {
        format!(" (the model has {})", list(available))
    }
}

fn candidates_note(candidates: &[String]) -> String {
    if candidates.is_empty() {
        String::new()
    } else {
        format!("; pass the key of the one to read: {}", list(candidates))
    }
}

fn group_note(group: Option<usize>) -> String {
    match group {
        Some(g) => format!(" (parameter group {g})"),
        None => String::new(),
    }
}
