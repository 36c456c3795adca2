//! A static, torchinfo-style summary of a module tree: [`ModuleExt::summary`](../module_runtime/trait.ModuleExt.html#method.summary).

use std::fmt;

use crate::module::Module;
use crate::walk::{walk, Visit};

/// One module of a [`Summary`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SummaryRow {
    /// The module's dotted path (`""` for the root).
    pub path: String,
    /// Its type, without module paths (`Linear`, `Vec<Block>`).
    pub type_name: String,
    /// Nesting depth: 0 for the root.
    pub depth: usize,
    /// Scalar parameters at or under this module, each parameter counted once in the whole tree
    /// (a tied weight counts under the first path that reaches it).
    pub params: usize,
    /// How many of them are trained (not frozen).
    pub trainable_params: usize,
    /// The shapes of the module's input tensors at its first call, from
    /// [`summary_with`](../module_runtime/trait.ModuleExt.html#method.summary_with) (`[32, 64]`, comma-separated for several).
    pub input_shape: Option<String>,
    /// The shapes of its output tensors at that call.
    pub output_shape: Option<String>,
}

/// A static summary of a model, from its structure alone (no forward pass): every module with its
/// path, type and parameter count, and totals. `Display` renders it as a table.
///
/// Parameters are counted once each, however many paths reach them (shared modules and tied
/// weights), like `num_parameters`. The size assumes each parameter's own dtype.
///
/// ```
/// use module_runtime::prelude::*;
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: Linear,
///     fc2: Linear,
/// }
///
/// let dev = Device::Cpu;
/// let model = Mlp { fc1: Linear::new(64, 32, &dev)?, fc2: Linear::new(32, 10, &dev)? };
/// model.freeze("fc1")?;
/// let summary = model.summary();
/// assert_eq!(summary.total_params, 64 * 32 + 32 + 32 * 10 + 10);
/// assert_eq!(summary.trainable_params, 32 * 10 + 10);
/// println!("{summary}");
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Every module, depth-first in declaration order, each once.
    pub rows: Vec<SummaryRow>,
    /// Scalar parameters in the model.
    pub total_params: usize,
    /// Scalar parameters that are trained.
    pub trainable_params: usize,
    /// Scalar parameters that are frozen.
    pub non_trainable_params: usize,
    /// Bytes the parameters take, each in its own dtype.
    pub param_bytes: usize,
}

impl Summary {
    /// Adds the input and output shapes recorded by a run (`(path, input, output)` rows).
    pub fn with_shapes(mut self, shapes: &[(String, String, String)]) -> Self {
        for row in &mut self.rows {
            if let Some((_, input, output)) = shapes.iter().find(|(p, _, _)| *p == row.path) {
                row.input_shape = Some(input.clone());
                row.output_shape = Some(output.clone());
            }
        }
        self
    }

    /// Summarizes `root`.
    pub fn of(root: &dyn Module) -> Self {
        let mut rows: Vec<SummaryRow> = Vec::new();
        // Indices into `rows` of the modules on the path to the current node.
        let mut ancestors: Vec<usize> = Vec::new();
        let (mut total, mut trainable, mut bytes) = (0, 0, 0);
        walk(root, true, &mut |path, visit| {
            let depth = if path.is_empty() {
                0
            } else {
                path.split('.').count()
            };
            // Depth-first: whatever is not an ancestor of this node is finished.
            ancestors.truncate(depth);
            match visit {
                Visit::Module(m) => {
                    ancestors.push(rows.len());
                    rows.push(SummaryRow {
                        path: path.to_owned(),
                        type_name: m.class_name(),
                        depth,
                        params: 0,
                        trainable_params: 0,
                        input_shape: None,
                        output_shape: None,
                    });
                }
                Visit::Param(p) => {
                    let n = p.elem_count();
                    let trained = if p.requires_grad() { n } else { 0 };
                    total += n;
                    trainable += trained;
                    bytes += n * p.dtype().size_in_bytes();
                    for &i in &ancestors {
                        rows[i].params += n;
                        rows[i].trainable_params += trained;
                    }
                }
                Visit::Buffer(_) | Visit::Mode(_) | Visit::Extra(_) => {}
            }
            true
        });
        Self {
            rows,
            total_params: total,
            trainable_params: trainable,
            non_trainable_params: total - trainable,
            param_bytes: bytes,
        }
    }

    /// The parameters' size in megabytes (10⁶ bytes, as torchinfo counts).
    pub fn param_megabytes(&self) -> f64 {
        self.param_bytes as f64 / 1e6
    }
}

/// `1234567` → `1,234,567`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl fmt::Display for Summary {
    /// ```text
    /// Module            Type       Params  Trainable
    /// ==============================================
    /// (root)            Mlp         2,410  partly
    ///   fc1             Linear      2,080  no
    ///   fc2             Linear        330  yes
    /// ==============================================
    /// Total params: 2,410
    /// ...
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = |row: &SummaryRow| {
            let name = if row.path.is_empty() {
                "(root)"
            } else {
                row.path.as_str()
            };
            format!("{}{name}", "  ".repeat(row.depth))
        };
        let name_w = self
            .rows
            .iter()
            .map(|r| label(r).chars().count())
            .chain([6])
            .max()
            .unwrap_or(6);
        let type_w = self
            .rows
            .iter()
            .map(|r| r.type_name.chars().count())
            .chain([4])
            .max()
            .unwrap_or(4);
        let count_w = self
            .rows
            .iter()
            .map(|r| thousands(r.params).len())
            .chain([6])
            .max()
            .unwrap_or(6);
        let shaped = self.rows.iter().any(|r| r.output_shape.is_some());
        let shape_w = |get: fn(&SummaryRow) -> &Option<String>, title: &str| {
            self.rows
                .iter()
                .map(|r| get(r).as_deref().unwrap_or("-").chars().count())
                .chain([title.len()])
                .max()
                .unwrap_or(0)
        };
        let in_w = shape_w(|r| &r.input_shape, "Input shape");
        let out_w = shape_w(|r| &r.output_shape, "Output shape");
        let shapes_width = if shaped { in_w + out_w + 4 } else { 0 };
        let width = name_w + type_w + count_w + 6 + 9 + shapes_width;
        let rule = "=".repeat(width);
        let shape_cols = |input: &str, output: &str| {
            if shaped {
                format!("  {input:<in_w$}  {output:<out_w$}")
            } else {
                String::new()
            }
        };
        writeln!(
            f,
            "{:<name_w$}  {:<type_w$}{}  {:>count_w$}  Trainable",
            "Module",
            "Type",
            shape_cols("Input shape", "Output shape"),
            "Params"
        )?;
        writeln!(f, "{rule}")?;
        for row in &self.rows {
            let trainable = match (row.params, row.trainable_params) {
                (0, _) => "-",
                (all, t) if t == all => "yes",
                (_, 0) => "no",
                _ => "partly",
            };
            writeln!(
                f,
                "{:<name_w$}  {:<type_w$}{}  {:>count_w$}  {trainable}",
                label(row),
                row.type_name,
                shape_cols(
                    row.input_shape.as_deref().unwrap_or("-"),
                    row.output_shape.as_deref().unwrap_or("-")
                ),
                thousands(row.params)
            )?;
        }
        writeln!(f, "{rule}")?;
        writeln!(f, "Total params: {}", thousands(self.total_params))?;
        writeln!(f, "Trainable params: {}", thousands(self.trainable_params))?;
        writeln!(
            f,
            "Non-trainable params: {}",
            thousands(self.non_trainable_params)
        )?;
        writeln!(f, "Params size (MB): {:.2}", self.param_megabytes())
    }
}
