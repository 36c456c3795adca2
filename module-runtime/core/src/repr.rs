//! `print(model)`: a module tree as PyTorch's `nn.Module.__repr__` prints it, each layer's
//! `extra_repr` included ([`ExtraRepr`], [`module_repr`]), and Python's spelling of the values
//! in it ([`py_float`], [`py_bool`]).

use std::fmt::Write;

use crate::module::{Child, Module};

/// The text a module shows inside its parentheses when printed: PyTorch's
/// `nn.Module.extra_repr` (`in_features=64, out_features=32, bias=True` for a `Linear`).
///
/// Implement it for a module type and mark the type `#[module(extra_repr)]`; the derive's
/// [`Module::extra_repr`] then returns it, and `model.to_string()` (or `println!("{model}")`)
/// shows it. Children are printed by the runtime, one per line: the text is only the module's
/// own settings.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::ExtraRepr;
///
/// #[derive(Module)]
/// #[module(extra_repr)]
/// struct Scale {
///     factor: f64,
///     proj: Linear,
/// }
///
/// impl ExtraRepr for Scale {
///     fn extra_repr(&self) -> String {
///         format!("factor={}", self.factor)
///     }
/// }
///
/// let m = Scale { factor: 0.5, proj: Linear::new(4, 2, &Device::Cpu)? };
/// assert_eq!(
///     m.to_string(),
///     "Scale(\n  factor=0.5\n  (proj): Linear(in_features=4, out_features=2, bias=True)\n)"
/// );
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub trait ExtraRepr {
    /// The module's own settings, as PyTorch's `extra_repr` returns them (may span lines).
    fn extra_repr(&self) -> String;

    /// How the submodule `child` is printed, where PyTorch's text differs from the submodule's
    /// own ([`ChildRepr`]); [`ChildRepr::Own`] (the default) for every child. Printing only:
    /// paths and state-dict keys are unchanged.
    fn child_repr(&self, child: &str) -> ChildRepr {
        let _ = child;
        ChildRepr::Own
    }

    /// The class name `print(model)` shows for this module, when it depends on the module's
    /// state rather than its type: a `Linear` holding a LoRA adapter prints as PEFT's
    /// `lora.Linear`. `None` (the default): the module's
    /// [`class_name`](Module::class_name). Printing only.
    fn class_repr(&self) -> Option<String> {
        None
    }
}

/// How `print(model)` shows one submodule ([`ExtraRepr::child_repr`]).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::ReLU;
/// use module_runtime::{ChildRepr, ExtraRepr};
///
/// #[derive(Module)]
/// #[module(extra_repr)]
/// struct Block {
///     proj: Linear,
///     act: ReLU,
/// }
///
/// impl ExtraRepr for Block {
///     fn extra_repr(&self) -> String {
///         String::new()
///     }
///
///     fn child_repr(&self, child: &str) -> ChildRepr {
///         match child {
///             "proj" => ChildRepr::Class("MyLinear"),
///             "act" => ChildRepr::Hidden,
///             _ => ChildRepr::Own,
///         }
///     }
/// }
///
/// let block = Block { proj: Linear::new(2, 3, &Device::Cpu)?, act: ReLU::new() };
/// assert_eq!(
///     block.to_string(),
///     "Block(\n  (proj): MyLinear(in_features=2, out_features=3, bias=True)\n)"
/// );
/// // Printing only: the state dict keeps its keys.
/// assert!(block.state_dict()?.contains_key("proj.weight"));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChildRepr {
    /// As the submodule prints itself (the default).
    #[default]
    Own,
    /// With another class name: `MultiheadAttention`'s `out_proj` is a `Linear` here and a
    /// `NonDynamicallyQuantizableLinear` (a subclass of `Linear`) in PyTorch.
    Class(&'static str),
    /// Not at all: a submodule that PyTorch holds as a plain function (a Transformer layer's
    /// `activation="relu"`).
    Hidden,
}

/// How `print(model)` shows `m`: PyTorch's `nn.Module.__repr__`. The class name (its
/// [`class_name`](Module::class_name), PyTorch's for the runtime's layers, without type
/// arguments), then the module's
/// [`extra_repr`](Module::extra_repr) and its submodules, one `(name): repr` per line, indented
/// by two spaces; a module with only a one-line `extra_repr` stays on one line
/// (`Linear(in_features=4, out_features=2, bias=True)`). Parameters and buffers are not listed.
///
/// A `ModuleList` shows consecutive children with the same text as one line,
/// `(0-2): 3 x Linear(...)`, as PyTorch's `ModuleList.__repr__` does; a `Vec` (or array) of
/// modules prints as that `ModuleList`, a `BTreeMap<String, _>` of them as a `ModuleDict`.
///
/// Derived modules and the runtime's layers implement `Display` with it, so
/// `println!("{model}")` is `print(model)`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::ReLU;
///
/// #[derive(Module)]
/// struct Net {
///     fc1: Linear,
///     act: ReLU,
/// }
///
/// let net = Net { fc1: Linear::new(64, 32, &Device::Cpu)?, act: ReLU::new() };
/// assert_eq!(
///     net.to_string(),
///     "Net(\n  (fc1): Linear(in_features=64, out_features=32, bias=True)\n  (act): ReLU()\n)"
/// );
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn module_repr(m: &dyn Module) -> String {
    repr_as(m, None)
}

/// [`module_repr`] of `m`, with the class name `class` if given (its parent's
/// [`ExtraRepr::child_repr`]).
fn repr_as(m: &dyn Module, class: Option<&str>) -> String {
    let mut children: Vec<(String, String)> = Vec::new();
    m.visit_children(&mut |name, child| {
        if let Child::Module { module, .. } = child {
            let name = name.to_string();
            let class = match m.__repr_child(&name) {
                ChildRepr::Hidden => return,
                ChildRepr::Class(class) => Some(class),
                ChildRepr::Own => None,
            };
            children.push((name, repr_as(module, class)));
        }
    });
    // PyTorch's class name has no type arguments: `ModuleList<Linear>` prints as `ModuleList`.
    // A `Vec` of modules is PyTorch's `ModuleList`, a map its `ModuleDict`, an adapted layer
    // PEFT's `lora.Linear`: the type's own class for printing.
    let full = m.__repr_class().unwrap_or_else(|| m.class_name());
    let name = class.unwrap_or_else(|| full.split('<').next().unwrap_or(&full));
    let mut lines: Vec<String> = Vec::new();
    if m.__repr_collapses_repeats() {
        if children.is_empty() {
            return format!("{name}()");
        }
        lines = collapsed(&children);
    } else {
        let extra = m.extra_repr();
        if !extra.is_empty() {
            lines.extend(extra.split('\n').map(str::to_owned));
        }
        if children.is_empty() && lines.len() <= 1 {
            return format!("{name}({})", lines.concat());
        }
        lines.extend(
            children
                .iter()
                .map(|(key, text)| format!("({key}): {text}")),
        );
    }
    let mut out = format!("{name}(");
    for line in &lines {
        out.push_str("\n  ");
        // `_addindent(text, 2)`: the lines after a child's first move in with it.
        out.push_str(&line.replace('\n', "\n  "));
    }
    out.push_str("\n)");
    out
}

/// `ModuleList.__repr__`'s lines: runs of children with the same text as `(i-j): n x text`.
fn collapsed(children: &[(String, String)]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut i = 0;
    while i < children.len() {
        let text = &children[i].1;
        let run = children[i..].iter().take_while(|(_, t)| t == text).count();
        let (first, last) = (&children[i].0, &children[i + run - 1].0);
        lines.push(match run {
            1 => format!("({first}): {text}"),
            n => format!("({first}-{last}): {n} x {text}"),
        });
        i += run;
    }
    lines
}

/// A float as Python's `repr` writes it: the shortest text that reads back as the same value,
/// with `.0` on whole numbers and an exponent below `1e-4` and from `1e16` on (`1e-05`, `0.1`,
/// `1.0`, `1e+16`), so that `extra_repr`s match PyTorch's text.
///
/// ```
/// use module_runtime::py_float;
/// assert_eq!(py_float(1e-5), "1e-05");
/// assert_eq!(py_float(0.1), "0.1");
/// assert_eq!(py_float(1.0), "1.0");
/// assert_eq!(py_float(-0.0001), "-0.0001");
/// assert_eq!(py_float(2.5e20), "2.5e+20");
/// ```
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip mantissa with its exponent (`1e-5`, `2.5e20`).
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}`'s exponent is a number");
    if x != 0.0 && !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let mut s = x.to_string();
    if !s.contains('.') {
        s.push_str(".0");
    }
    s
}

/// `True` or `False`, as Python prints a bool.
pub fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// Writes `values` as a Python tuple: `(3,)` for one, `(3, 3)` for two, `(2, -1)` for signed ones.
pub fn py_tuple<T: std::fmt::Display>(values: &[T]) -> String {
    let mut s = String::from("(");
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{v}");
    }
    if values.len() == 1 {
        s.push(',');
    }
    s.push(')');
    s
}
