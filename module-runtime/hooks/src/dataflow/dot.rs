//! A [`Dataflow`] as text: Graphviz DOT (clusters for calls with children, boxes with shapes and
//! parameter counts for the others), rendered to a file through `dot`, and a line per edge
//! (`Display`).

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::path::Path;

use super::{Dataflow, DataflowNode, NodeKind};
use crate::error::{Error, Result};

impl Dataflow {
    /// Graphviz DOT text of this view: calls with children as clusters labelled with their path,
    /// type and parameter count; other calls as boxes with their input → output shapes and
    /// parameters; ops nodes as small grey notes; inputs and outputs as ellipses; edges labelled
    /// with the tensor's shape.
    pub fn to_dot(&self) -> String {
        let mut out = String::new();
        out.push_str("digraph dataflow {\n");
        out.push_str("  rankdir=TB;\n");
        out.push_str("  fontname=\"Helvetica\"; fontsize=10;\n");
        out.push_str(
            "  node [shape=box, style=\"rounded,filled\", fillcolor=\"#e8f0fe\", \
             fontname=\"Helvetica\", fontsize=10];\n",
        );
        out.push_str("  edge [fontname=\"Helvetica\", fontsize=9, color=\"#555555\"];\n");
        let mut children: HashMap<Option<usize>, Vec<&DataflowNode>> = HashMap::new();
        for n in &self.nodes {
            children.entry(n.parent).or_default().push(n);
        }
        self.write_level(&mut out, &children, None, 1);
        for e in &self.edges {
            let _ = writeln!(
                out,
                "  n{} -> n{} [label=\"{}\"];",
                e.from,
                e.to,
                escape(&shape_text(&e.shape))
            );
        }
        out.push_str("}\n");
        out
    }

    fn write_level(
        &self,
        out: &mut String,
        children: &HashMap<Option<usize>, Vec<&DataflowNode>>,
        parent: Option<usize>,
        indent: usize,
    ) {
        let pad = "  ".repeat(indent);
        for n in children.get(&parent).into_iter().flatten() {
            if n.expanded {
                let _ = writeln!(out, "{pad}subgraph cluster_{} {{", n.id);
                let mut label = n.label();
                if n.params > 0 {
                    label.push_str(&format!(" · {} params", thousands(n.params)));
                }
                let _ = writeln!(
                    out,
                    "{pad}  label=\"{}\"; labeljust=l; style=\"rounded,dashed\"; color=\"#888888\";",
                    escape(&label)
                );
                self.write_level(out, children, Some(n.id), indent + 1);
                let _ = writeln!(out, "{pad}}}");
                continue;
            }
            let (lines, attrs) = match n.kind {
                NodeKind::Call => {
                    let mut lines = vec![n.label()];
                    lines.push(format!(
                        "{} → {}",
                        shapes_text(&n.input_shapes),
                        shapes_text(&n.output_shapes)
                    ));
                    if n.params > 0 {
                        lines.push(format!("{} params", thousands(n.params)));
                    }
                    (lines, "")
                }
                NodeKind::Ops => {
                    let what = match n.ops {
                        0 => "tensor\n(no traced inputs)".to_owned(),
                        1 => "1 op".to_owned(),
                        k => format!("{k} ops"),
                    };
                    (
                        vec![what],
                        ", shape=note, fillcolor=\"#f1f1f1\", fontsize=9",
                    )
                }
                NodeKind::Input | NodeKind::Output => (
                    vec![
                        n.label().trim_end().to_owned(),
                        shapes_text(if n.kind == NodeKind::Input {
                            &n.output_shapes
                        } else {
                            &n.input_shapes
                        }),
                    ],
                    ", shape=ellipse, fillcolor=\"#fff4d6\"",
                ),
            };
            let label = lines
                .iter()
                .map(|l| escape(l))
                .collect::<Vec<_>>()
                .join("\\n");
            let _ = writeln!(out, "{pad}n{} [label=\"{label}\"{attrs}];", n.id);
        }
    }

    /// Renders this view through Graphviz's `dot` to `path`, in the format its extension names
    /// (`svg`, `png`, `pdf`, …: `dot -T<ext>`).
    ///
    /// Fails with [`Error::GraphvizNotFound`] when `dot` is not on `PATH` (install Graphviz, or
    /// write [`to_dot`](Self::to_dot) to a file and render it elsewhere), and with
    /// [`Error::Render`] when `dot` fails or the path has no extension.
    pub fn render(&self, path: impl AsRef<Path>) -> Result<()> {
        self.render_with(path, "dot")
    }

    /// [`render`](Self::render) with another Graphviz program or path to `dot` (`"neato"`,
    /// `"/opt/graphviz/bin/dot"`).
    pub fn render_with(&self, path: impl AsRef<Path>, command: &str) -> Result<()> {
        let path = path.as_ref();
        let render_err = |reason: String| Error::Render {
            path: path.to_owned(),
            reason,
        };
        let format = path
            .extension()
            .and_then(|e| e.to_str())
            .filter(|e| !e.is_empty())
            .ok_or_else(|| {
                render_err("no extension to take the format from (`.svg`, `.png`)".into())
            })?;
        let child = std::process::Command::new(command)
            .arg(format!("-T{format}"))
            .arg("-o")
            .arg(path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::GraphvizNotFound {
                    command: command.to_owned(),
                    path: path.to_owned(),
                })
            }
            Err(e) => return Err(render_err(format!("cannot run `{command}`: {e}"))),
        };
        let written = child
            .stdin
            .take()
            .map(|mut stdin| stdin.write_all(self.to_dot().as_bytes()));
        let output = child
            .wait_with_output()
            .map_err(|e| render_err(format!("`{command}` did not finish: {e}")))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(render_err(format!(
                "`{command} -T{format}` failed ({}): {}",
                output.status,
                stderr.trim()
            )));
        }
        if let Some(Err(e)) = written {
            return Err(render_err(format!("writing to `{command}`: {e}")));
        }
        Ok(())
    }
}

/// One line per edge, each node with its id (two ops nodes of one module differ by it):
/// `#1 stem: Linear -> #3 block.fc: Linear [3, 8]`.
impl fmt::Display for Dataflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = |id: usize| match self.get(id) {
            Some(n) => format!("#{id} {}", n.label()),
            None => format!("#{id}"),
        };
        for e in &self.edges {
            writeln!(
                f,
                "{} -> {} {}",
                label(e.from),
                label(e.to),
                shape_text(&e.shape)
            )?;
        }
        Ok(())
    }
}

fn shape_text(shape: &[usize]) -> String {
    format!("{shape:?}")
}

fn shapes_text(shapes: &[Vec<usize>]) -> String {
    match shapes {
        [] => "()".to_owned(),
        [one] => shape_text(one),
        many => many
            .iter()
            .map(|s| shape_text(s))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// `12345` → `12,345`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Escapes text for a double-quoted DOT string.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}
