//! Parameter groups: which parameters share hyperparameters, chosen by path pattern.

use module_core::{Param, PathPattern};
use module_hooks::ModuleExt;

use crate::error::{Error, Result};

/// Builder setters, `pub fn name(mut self, name: T) -> Self`, each with its doc comment: they
/// store `name`, or with `optional:` first, `Some(name)` (a group's overrides).
macro_rules! setters {
    (optional: $($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $name: $ty) -> Self {
            self.$name = Some($name);
            self
        }
    )*};
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $name: $ty) -> Self {
            self.$name = $name;
            self
        }
    )*};
}
pub(crate) use setters;

/// A boolean hyperparameter as a state dict value, 0 or 1 (what [`GroupOptions`] records for a
/// flag it sets, and what an optimizer's state dict holds).
pub(crate) fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
}

/// Hyperparameters a parameter group overrides; everything left unset is the optimizer's
/// default. Which options exist depends on the optimizer: setting one it does not have (`betas`
/// on [`SGD`](crate::SGD)) is an [`Error::NotApplicable`] when the optimizer is made.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GroupOptions {
    pub(crate) lr: Option<f64>,
    pub(crate) weight_decay: Option<f64>,
    pub(crate) betas: Option<(f64, f64)>,
    pub(crate) eps: Option<f64>,
    pub(crate) amsgrad: Option<bool>,
    pub(crate) momentum: Option<f64>,
    pub(crate) dampening: Option<f64>,
    pub(crate) nesterov: Option<bool>,
    pub(crate) maximize: Option<bool>,
}

impl GroupOptions {
    setters! {
        optional:
        /// The group's learning rate.
        lr: f64,
        /// The group's weight decay (`0.0`: none, the usual choice for biases and norm weights).
        weight_decay: f64,
    }
    /// The group's `(beta1, beta2)` (Adam, AdamW).
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.betas = Some((beta1, beta2));
        self
    }
    setters! {
        optional:
        /// The group's `eps` (Adam, AdamW).
        eps: f64,
        /// Whether the group uses AMSGrad (Adam, AdamW).
        amsgrad: bool,
        /// The group's momentum (SGD).
        momentum: f64,
        /// The group's dampening (SGD).
        dampening: f64,
        /// Whether the group uses Nesterov momentum (SGD).
        nesterov: bool,
        /// Whether the group maximizes its objective instead of minimizing it.
        maximize: bool,
    }
}

impl GroupOptions {
    /// The options the group sets, each as its name, the state dict name of each value it sets
    /// (`betas` sets `betas.0` and `betas.1`) and that value (booleans as 0 or 1), in the
    /// fields' order.
    pub(crate) fn values(&self) -> Vec<(&'static str, &'static str, f64)> {
        let set_flag = |b: Option<bool>| b.map(flag);
        let values = [
            ("lr", "lr", self.lr),
            ("weight_decay", "weight_decay", self.weight_decay),
            ("betas", "betas.0", self.betas.map(|b| b.0)),
            ("betas", "betas.1", self.betas.map(|b| b.1)),
            ("eps", "eps", self.eps),
            ("amsgrad", "amsgrad", set_flag(self.amsgrad)),
            ("momentum", "momentum", self.momentum),
            ("dampening", "dampening", self.dampening),
            ("nesterov", "nesterov", set_flag(self.nesterov)),
            ("maximize", "maximize", set_flag(self.maximize)),
        ];
        values
            .into_iter()
            .filter_map(|(option, name, value)| Some((option, name, value?)))
            .collect()
    }
}

/// How an optimizer's parameters are split into groups, each with its own hyperparameters:
/// PyTorch's list of `param_groups` dicts, chosen by path pattern
/// ([`PathPattern`](module_core::PathPattern): `**.bias`, `encoder.layer.*`, `encoder`)
/// instead of by listing parameters.
///
/// Groups come in the order they are declared. A pattern selects the parameters at or under the
/// paths it matches (`encoder` selects every parameter in the encoder, as `freeze` does). Every
/// trainable parameter no group selects goes to the *rest* group, which has the optimizer's
/// defaults unless [`rest`](Self::rest) overrides them, and which sits where `rest` was called
/// (at the end if it was not called, and then only if it is not empty).
///
/// When the optimizer is made:
///
/// - a pattern that matches no parameter (trainable or frozen) is [`Error::PatternMatchesNothing`];
/// - a parameter two groups select is [`Error::ParamInTwoGroups`] (two patterns of one group may
///   select it both);
/// - frozen parameters (`requires_grad` false) are left out of every group.
///
/// Hugging Face's Trainer habit, no weight decay for biases and LayerNorm weights:
///
/// ```
/// use module_runtime::optim::ParamGroups;
/// let groups = ParamGroups::new().group(["**.bias", "**.LayerNorm.weight"], |g| g.weight_decay(0.0));
/// ```
#[derive(Clone, Debug, Default)]
pub struct ParamGroups {
    specs: Vec<Spec>,
}

#[derive(Clone, Debug)]
enum Spec {
    Group(Vec<String>, GroupOptions),
    Rest(GroupOptions),
}

/// One or several path patterns: a `&str`, a `String`, an array, a slice or a `Vec` of them.
pub trait Patterns {
    /// The patterns as strings.
    fn into_patterns(self) -> Vec<String>;
}

impl Patterns for &str {
    fn into_patterns(self) -> Vec<String> {
        vec![self.to_owned()]
    }
}
impl Patterns for String {
    fn into_patterns(self) -> Vec<String> {
        vec![self]
    }
}
impl<S: AsRef<str>, const N: usize> Patterns for [S; N] {
    fn into_patterns(self) -> Vec<String> {
        self.iter().map(|s| s.as_ref().to_owned()).collect()
    }
}
impl<S: AsRef<str>> Patterns for &[S] {
    fn into_patterns(self) -> Vec<String> {
        self.iter().map(|s| s.as_ref().to_owned()).collect()
    }
}
impl<S: AsRef<str>> Patterns for Vec<S> {
    fn into_patterns(self) -> Vec<String> {
        self.iter().map(|s| s.as_ref().to_owned()).collect()
    }
}

impl ParamGroups {
    /// No groups: every trainable parameter in one group with the optimizer's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a group of the parameters at or under the paths `patterns` match, with the
    /// hyperparameters `options` sets over the optimizer's defaults.
    pub fn group(
        mut self,
        patterns: impl Patterns,
        options: impl FnOnce(GroupOptions) -> GroupOptions,
    ) -> Self {
        self.specs.push(Spec::Group(
            patterns.into_patterns(),
            options(GroupOptions::default()),
        ));
        self
    }

    /// Places the group of the parameters no other group selects here, with the hyperparameters
    /// `options` sets over the optimizer's defaults. Calling it again replaces the earlier call.
    pub fn rest(mut self, options: impl FnOnce(GroupOptions) -> GroupOptions) -> Self {
        self.specs.retain(|s| !matches!(s, Spec::Rest(_)));
        self.specs
            .push(Spec::Rest(options(GroupOptions::default())));
        self
    }

    /// Splits `named` (a model's `named_parameters()`) into groups.
    pub(crate) fn resolve(&self, named: Vec<(String, Param)>) -> Result<Vec<ResolvedGroup>> {
        let unbuilt: Vec<String> = named
            .iter()
            .filter(|(_, p)| !p.is_built())
            .map(|(path, _)| path.clone())
            .collect();
        if !unbuilt.is_empty() {
            return Err(Error::Unbuilt { paths: unbuilt });
        }
        let mut seen = std::collections::HashMap::new();
        for (path, p) in &named {
            if let Some(first) = seen.insert(p.id(), path) {
                return Err(Error::DuplicateParam {
                    path: path.clone(),
                    first: first.clone(),
                });
            }
        }
        // For each declared group: its patterns, parsed.
        let mut parsed: Vec<Option<Vec<PathPattern>>> = Vec::new();
        for spec in &self.specs {
            parsed.push(match spec {
                Spec::Group(patterns, _) => Some(
                    patterns
                        .iter()
                        .map(|p| PathPattern::new(p))
                        .collect::<module_core::Result<_>>()?,
                ),
                Spec::Rest(_) => None,
            });
        }
        // Which group each parameter is in: (group index in `specs`, pattern).
        let mut owner: Vec<Option<(usize, usize)>> = vec![None; named.len()];
        for (g, patterns) in parsed.iter().enumerate() {
            let Some(patterns) = patterns else { continue };
            for (k, pattern) in patterns.iter().enumerate() {
                let mut matched = false;
                for (i, (path, _)) in named.iter().enumerate() {
                    if !pattern.matches_at_or_above(path) {
                        continue;
                    }
                    matched = true;
                    match owner[i] {
                        None => owner[i] = Some((g, k)),
                        Some((g0, _)) if g0 == g => {}
                        Some((g0, k0)) => {
                            let pattern_of = |g: usize, k: usize| match &self.specs[g] {
                                Spec::Group(p, _) => p[k].clone(),
                                Spec::Rest(_) => unreachable!("the rest group has no pattern"),
                            };
                            return Err(Error::ParamInTwoGroups {
                                path: path.clone(),
                                first_group: g0,
                                first: pattern_of(g0, k0),
                                second_group: g,
                                second: pattern_of(g, k),
                            });
                        }
                    }
                }
                if !matched {
                    // PyTorch code picks groups by substring (`"bias" in name`); a pattern matches
                    // whole paths, and `**.bias` is what such a substring meant.
                    let anywhere = format!("**.{}", pattern.as_str());
                    let suggestion = PathPattern::new(&anywhere).ok().and_then(|p| {
                        named
                            .iter()
                            .any(|(path, _)| p.matches_at_or_above(path))
                            .then_some(anywhere)
                    });
                    return Err(Error::PatternMatchesNothing {
                        pattern: pattern.as_str().to_owned(),
                        available: named.iter().take(10).map(|(p, _)| p.clone()).collect(),
                        suggestion,
                    });
                }
            }
        }
        let rest_declared = self.specs.iter().any(|s| matches!(s, Spec::Rest(_)));
        let mut out: Vec<ResolvedGroup> = self
            .specs
            .iter()
            .map(|s| ResolvedGroup {
                options: match s {
                    Spec::Group(_, o) | Spec::Rest(o) => o.clone(),
                },
                params: Vec::new(),
            })
            .collect();
        if !rest_declared {
            out.push(ResolvedGroup {
                options: GroupOptions::default(),
                params: Vec::new(),
            });
        }
        let rest = self
            .specs
            .iter()
            .position(|s| matches!(s, Spec::Rest(_)))
            .unwrap_or(out.len() - 1);
        for ((path, param), owner) in named.into_iter().zip(owner) {
            if !param.requires_grad() {
                continue;
            }
            let g = owner.map_or(rest, |(g, _)| g);
            out[g].params.push((path, param));
        }
        if !rest_declared && out.last().is_some_and(|g| g.params.is_empty()) {
            out.pop();
        }
        if out.iter().all(|g| g.params.is_empty()) {
            return Err(Error::NoParameters);
        }
        Ok(out)
    }
}

/// A group as [`ParamGroups::resolve`] gives it: its overrides and its parameters.
pub(crate) struct ResolvedGroup {
    pub(crate) options: GroupOptions,
    pub(crate) params: Vec<(String, Param)>,
}

/// One parameter group of an optimizer: its hyperparameters (`options`, which a learning-rate
/// schedule changes) and its parameters, with their paths.
#[derive(Clone)]
pub struct ParamGroup<O> {
    /// The group's hyperparameters. Changing them between steps takes effect on the next step, as
    /// changing `optimizer.param_groups[i]["lr"]` does in PyTorch.
    pub options: O,
    pub(crate) params: Vec<(String, Param)>,
}

impl<O> ParamGroup<O> {
    /// The group's parameters with their paths, in the model's order.
    pub fn params(&self) -> &[(String, Param)] {
        &self.params
    }
}

impl<O: std::fmt::Debug> std::fmt::Debug for ParamGroup<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamGroup")
            .field("options", &self.options)
            .field(
                "params",
                &self.params.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What an optimizer is made over: a model (every parameter of its `named_parameters()`), or a
/// list of `(path, parameter)` pairs.
pub trait NamedParams {
    /// The parameters with their paths.
    fn named_params(&self) -> Vec<(String, Param)>;
}

impl<M: ModuleExt + ?Sized> NamedParams for M {
    fn named_params(&self) -> Vec<(String, Param)> {
        self.named_parameters()
    }
}

/// A list of parameters with paths, for optimizers over parameters that are not in one model.
#[derive(Clone, Default)]
pub struct ParamList(pub Vec<(String, Param)>);

impl NamedParams for ParamList {
    fn named_params(&self) -> Vec<(String, Param)> {
        self.0.clone()
    }
}
