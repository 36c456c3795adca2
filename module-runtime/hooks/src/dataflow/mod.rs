//! The dataflow graph of one run: [`ModuleExt::dataflow`](crate::ModuleExt::dataflow) (Ivy's
//! `show_graph`, PyTorch's torchview/torchviz), exported as Graphviz DOT and rendered through `dot`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{Tensor, TensorId, Var};

use crate::error::Result;
use crate::hooks::{HookOptions, Hooks, PreHookOptions};
use crate::module::Module;
use crate::param::Param;

mod dot;

/// What a [`DataflowNode`] stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// A tensor handed to the outermost call from outside (the run's input).
    Input,
    /// A tensor returned by an outermost call that no later call consumed (the run's output).
    Output,
    /// One call of a module.
    Call,
    /// Tensor-level work done in a module's `forward` outside any submodule call (`relu()`, `+`,
    /// `reshape`): one node per tensor that such work produced and a call consumed (or returned).
    Ops,
}

/// One node of a [`Dataflow`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataflowNode {
    /// Its index in [`Dataflow::nodes`] of the full graph; ids are the same in every
    /// [`collapse`](Dataflow::collapse)d view.
    pub id: usize,
    /// What it stands for.
    pub kind: NodeKind,
    /// The module's path for a call (`""` for the root); for an ops node the path of the module
    /// whose `forward` did the work; `""` for inputs and outputs.
    pub path: String,
    /// The module's type without module paths (`Linear`); empty for other nodes.
    pub type_name: String,
    /// The call this node ran in (the enclosing call; `None` at the outermost level).
    pub parent: Option<usize>,
    /// How many calls enclose it: 0 for the outermost call (and for inputs and outputs).
    pub depth: usize,
    /// Shapes of the tensors that went in (for a call, its input tensors in
    /// [`TensorTree`](crate::TensorTree) order; for an output node, the output's shape).
    pub input_shapes: Vec<Vec<usize>>,
    /// Shapes of the tensors that came out (for an ops node or an input, the one tensor's shape).
    pub output_shapes: Vec<Vec<usize>>,
    /// Scalar parameters at or under the called module, each counted once; 0 for other nodes.
    pub params: usize,
    /// For an ops node: how many candle operations made its tensor from the recorded tensors it
    /// has edges from (0 for a tensor made from nothing recorded).
    pub ops: usize,
    /// In this view: whether the node is drawn as a box around its children (a call that has
    /// children and is shallower than the view's depth) rather than as one box. Edges never touch
    /// an expanded node; they go to and from what is inside it.
    pub expanded: bool,
}

impl DataflowNode {
    /// A one-line name: `block.fc: Linear`, `Net` for the root, `ops in block`, `input 0`.
    pub fn label(&self) -> String {
        match self.kind {
            NodeKind::Call if self.path.is_empty() => self.type_name.clone(),
            NodeKind::Call => format!("{}: {}", self.path, self.type_name),
            NodeKind::Ops if self.path.is_empty() => "ops".to_owned(),
            NodeKind::Ops => format!("ops in {}", self.path),
            NodeKind::Input => format!("input {}", self.path),
            NodeKind::Output => format!("output {}", self.path),
        }
    }
}

/// One edge of a [`Dataflow`]: a tensor produced by (or inside) `from` and consumed by (or inside)
/// `to`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DataflowEdge {
    /// The producing node's id.
    pub from: usize,
    /// The consuming node's id.
    pub to: usize,
    /// The tensor's shape.
    pub shape: Vec<usize>,
}

/// A recorded tensor: what produced it and, for a call's output, what inside the call did.
#[derive(Clone, Debug)]
struct Port {
    producer: usize,
    shape: Vec<usize>,
    /// For a call's output: the tensor inside the call that it returned (a child's output, an ops
    /// node's tensor, or one of the call's inputs passed through); `None` for a call without
    /// children (its own work).
    inner: Option<usize>,
}

/// The whole recording; views are computed from it.
#[derive(Debug, Default)]
struct Trace {
    nodes: Vec<DataflowNode>,
    ports: Vec<Port>,
    /// `(port, consumer node)`, in the order they were seen.
    uses: Vec<(usize, usize)>,
}

/// The dataflow graph of one run of a model, from
/// [`ModuleExt::dataflow`](crate::ModuleExt::dataflow): module calls as nodes, tensors as edges.
///
/// A `Dataflow` is a *view* of the recording at some depth: [`collapse`](Self::collapse) gives
/// views where calls at the given depth are single boxes. [`to_dot`](Self::to_dot) writes Graphviz
/// DOT (calls with children as clusters), [`render`](Self::render) runs `dot` on it, and `Display`
/// lists the edges as text.
///
/// ```
/// use module_runtime::prelude::*;
///
/// #[derive(Module)]
/// struct Block {
///     fc: Linear,
/// }
///
/// impl Forward<&Tensor> for Block {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         Ok((self.fc.call(x)?.relu()? + x)?) // a residual connection
///     }
/// }
///
/// #[derive(Module)]
/// struct Net {
///     stem: Linear,
///     block: Block,
///     head: Linear,
/// }
///
/// impl Forward<&Tensor> for Net {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         let h = self.block.call(&self.stem.call(x)?)?;
///         self.head.call(&h)
///     }
/// }
///
/// let dev = Device::Cpu;
/// let net = Net {
///     stem: Linear::new(4, 8, &dev)?,
///     block: Block { fc: Linear::new(8, 8, &dev)? },
///     head: Linear::new(8, 2, &dev)?,
/// };
/// let x = Tensor::ones((3, 4), DType::F32, &dev)?;
/// let graph = net.dataflow(|m| m.call(&x))?;
///
/// // `stem`'s output feeds `block.fc`, and skips it: it also feeds the `+` in `block`.
/// let stem = graph.node("stem").unwrap();
/// let targets: Vec<_> = graph.edges_from(stem.id).map(|e| graph.nodes()[e.to].label()).collect();
/// assert_eq!(targets, ["block.fc: Linear", "ops in block"]);
/// assert_eq!(stem.output_shapes, [vec![3, 8]]);
/// assert_eq!(stem.params, 4 * 8 + 8);
///
/// // One level down: `block` is one box, the skip is inside it.
/// let shallow = graph.collapse(1);
/// assert!(shallow.node("block.fc").is_none());
/// assert!(shallow.to_dot().contains("label=\"[3, 8]\""));
///
/// // Rendering needs Graphviz's `dot`; without it the error says so.
/// # let dir = std::env::temp_dir();
/// match graph.render(dir.join("net.svg")) {
///     Ok(()) => {}
///     Err(Error::GraphvizNotFound { .. }) => eprintln!("install Graphviz to render"),
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// # How the edges are found
///
/// The run goes through [`Hooks`] with a global pre-hook and a global forward hook, which see every
/// [`call`](crate::ModuleExt::call):
///
/// - **By identity.** Every tensor a call returns is replaced by a copy that is a fresh candle
///   variable ([`Var`]), and remembered by its [`TensorId`]. A later call whose input is that very
///   tensor gets an edge from the call that produced it, however far apart they are: a residual
///   connection that hands a block's input to a later call is an edge that skips the calls between.
/// - **Tensor-level work** (`relu()`, `+`, `reshape` written in a `forward` rather than done by a
///   submodule) makes tensors no call returned. For such a tensor, candle's own record of the
///   operations ([`Tensor::sorted_nodes`]) is walked back; the walk stops at variables, so it stops
///   exactly at the nearest recorded tensors. The tensor becomes an *ops node* in the module whose
///   `forward` did the work, with an edge from each recorded tensor it was computed from and the
///   number of candle operations in between. `relu(fc(x)) + x` is an ops node with edges from
///   `fc` and from whatever produced `x`: the skip is there even though `+` is not a module.
/// - The tensors handed to the first call that match nothing become *input* nodes; the outputs of
///   the outermost calls that nothing consumed become *output* nodes.
///
/// # Limits
///
/// - The run is a trace: outputs are copied into fresh variables, so gradients do not flow across
///   module boundaries during it and every call output costs a copy. Do not train inside it; the
///   closure's result is dropped.
/// - candle keeps no public record of *which* operation made a tensor (`Tensor::op` is private in
///   candle 0.11), so ops nodes count candle operations rather than name them.
/// - candle records no operation on integer tensors (token ids, argmax) except where one feeds a
///   floating-point operation directly (`index_select`, `gather`), so dataflow through integer
///   arithmetic outside modules is followed by identity only; a tensor made from nothing recorded
///   (`Tensor::zeros`, a buffer read) is an ops node without incoming edges.
/// - A tensor computed from a recorded one both directly and through another recorded tensor
///   (`h = 2 * x` handed to a call, then `h + x`) gets an edge from the nearer one only (`h`):
///   candle's record says what a tensor depends on, not through which path.
/// - candle's walk does not follow `to_dtype` from an integer tensor, so a mask converted to
///   floats inside a `forward` (`mask.to_dtype(F32)`) has no edge into what it masks; a mask
///   handed over as floats, or applied with `where_cond`, has.
/// - A module called through `forward` instead of `call`, or one outside the model's tree, is
///   invisible: its work shows up as tensor-level work of its caller.
/// - Depth counts calls, not path segments: `encoder.layer.0` is called by `encoder` (the `Vec`
///   in between is not called), so it is at depth 2.
#[derive(Clone, Debug)]
pub struct Dataflow {
    trace: Arc<Trace>,
    depth: Option<usize>,
    nodes: Vec<DataflowNode>,
    edges: Vec<DataflowEdge>,
}

impl Dataflow {
    /// The nodes of this view: every node at most [`depth`](Self::depth) deep, in the order they
    /// were recorded (a call before what runs inside it; an ops node just before the call that
    /// consumed its tensor).
    pub fn nodes(&self) -> &[DataflowNode] {
        &self.nodes
    }

    /// The edges of this view, each once per (from, to, shape), in the order first seen.
    pub fn edges(&self) -> &[DataflowEdge] {
        &self.edges
    }

    /// The node with this id, if this view shows it.
    pub fn get(&self, id: usize) -> Option<&DataflowNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The (first) call of the module at `path`, if this view shows it.
    pub fn node(&self, path: &str) -> Option<&DataflowNode> {
        self.nodes
            .iter()
            .find(|n| n.kind == NodeKind::Call && n.path == path)
    }

    /// Every node of this view of one kind.
    pub fn nodes_of(&self, kind: NodeKind) -> impl Iterator<Item = &DataflowNode> {
        self.nodes.iter().filter(move |n| n.kind == kind)
    }

    /// The edges leaving node `id`.
    pub fn edges_from(&self, id: usize) -> impl Iterator<Item = &DataflowEdge> {
        self.edges.iter().filter(move |e| e.from == id)
    }

    /// The edges entering node `id`.
    pub fn edges_to(&self, id: usize) -> impl Iterator<Item = &DataflowEdge> {
        self.edges.iter().filter(move |e| e.to == id)
    }

    /// The depth of this view: `None` for the full graph.
    pub fn depth(&self) -> Option<usize> {
        self.depth
    }

    /// The view where calls `depth` deep are single boxes (their submodules and tensor-level work
    /// hidden, edges into and out of them kept): `collapse(0)` is the model as one box between its
    /// inputs and outputs, `collapse(1)` shows the root's direct submodule calls, and so on.
    /// Calls deeper than the recording are unaffected; collapsing again starts from the full graph.
    pub fn collapse(&self, depth: usize) -> Dataflow {
        Self::view(self.trace.clone(), Some(depth))
    }

    /// The full graph again, from a collapsed view.
    pub fn expand(&self) -> Dataflow {
        Self::view(self.trace.clone(), None)
    }

    fn view(trace: Arc<Trace>, depth: Option<usize>) -> Dataflow {
        let max = depth.unwrap_or(usize::MAX);
        let mut has_children = vec![false; trace.nodes.len()];
        for n in &trace.nodes {
            if let Some(p) = n.parent {
                has_children[p] = true;
            }
        }
        let expanded = |id: usize| {
            let n = &trace.nodes[id];
            n.kind == NodeKind::Call && has_children[id] && n.depth < max
        };
        // The node that stands for `id` in this view: itself, or its ancestor `max` deep.
        let shown = |mut id: usize| {
            while trace.nodes[id].depth > max {
                match trace.nodes[id].parent {
                    Some(p) => id = p,
                    None => break,
                }
            }
            id
        };
        let nodes = trace
            .nodes
            .iter()
            .filter(|n| n.depth <= max)
            .map(|n| DataflowNode {
                expanded: expanded(n.id),
                ..n.clone()
            })
            .collect();
        let mut edges: Vec<DataflowEdge> = Vec::new();
        for &(port, consumer) in &trace.uses {
            // What an expanded call consumes is drawn where it is consumed inside it.
            if expanded(consumer) {
                continue;
            }
            // What an expanded call returns is drawn from where it was made inside it.
            let mut p = port;
            while expanded(trace.ports[p].producer) {
                match trace.ports[p].inner {
                    Some(inner) => p = inner,
                    None => break,
                }
            }
            let edge = DataflowEdge {
                from: shown(trace.ports[p].producer),
                to: shown(consumer),
                shape: trace.ports[port].shape.clone(),
            };
            if edge.from != edge.to && !edges.contains(&edge) {
                edges.push(edge);
            }
        }
        Dataflow {
            trace,
            depth,
            nodes,
            edges,
        }
    }
}

/// The recording in progress.
#[derive(Default)]
struct Recorder {
    trace: Trace,
    /// Recorded tensors by id: call outputs (the fresh variables), inputs, ops nodes' tensors.
    by_id: HashMap<TensorId, usize>,
    /// The calls running, innermost last.
    stack: Vec<usize>,
    has_children: Vec<bool>,
}

impl Recorder {
    fn add_node(&mut self, mut node: DataflowNode) -> usize {
        let id = self.trace.nodes.len();
        node.id = id;
        if let Some(p) = node.parent {
            self.has_children[p] = true;
        }
        self.trace.nodes.push(node);
        self.has_children.push(false);
        id
    }

    fn add_port(&mut self, producer: usize, shape: Vec<usize>, inner: Option<usize>) -> usize {
        self.trace.ports.push(Port {
            producer,
            shape,
            inner,
        });
        self.trace.ports.len() - 1
    }

    fn depth_in(&self, scope: Option<usize>) -> usize {
        scope.map_or(0, |p| self.trace.nodes[p].depth + 1)
    }

    /// The port of a tensor no call returned, made in `scope`: walks candle's record back to the
    /// nearest recorded tensors. candle's walk stops at variables (call outputs, and the tensors
    /// handed to calls as the calls see them), but not at a tensor of tensor-level work that the
    /// `forward` kept and also handed to a call (a pre-norm residual `x = x + f(norm(x))`, whose
    /// `x` is added to again): the walk runs on into what that tensor was made from. Whatever is
    /// reached only through such a recorded tensor is its input, not this tensor's: left out.
    fn untracked(&mut self, t: &Tensor, scope: Option<usize>) -> usize {
        let walk = t.sorted_nodes();
        let mut behind: HashSet<TensorId> = HashSet::new();
        for n in &walk {
            if n.id() != t.id() && !n.is_variable() && self.by_id.contains_key(&n.id()) {
                behind.extend(n.sorted_nodes().iter().skip(1).map(|m| m.id()));
            }
        }
        let mut frontier: Vec<usize> = Vec::new();
        let mut ops = 0;
        for n in walk.into_iter().filter(|n| !behind.contains(&n.id())) {
            match self.by_id.get(&n.id()) {
                Some(&p) if !frontier.contains(&p) => frontier.push(p),
                Some(_) => {}
                None if !n.is_variable() => ops += 1,
                None => {} // a parameter
            }
        }
        frontier.sort_unstable();
        let shape = t.dims().to_vec();
        let node = if scope.is_none() && frontier.is_empty() {
            let k = self
                .trace
                .nodes
                .iter()
                .filter(|n| n.kind == NodeKind::Input)
                .count();
            self.add_node(DataflowNode {
                kind: NodeKind::Input,
                path: k.to_string(),
                output_shapes: vec![shape.clone()],
                ..blank()
            })
        } else {
            self.add_node(DataflowNode {
                kind: NodeKind::Ops,
                path: scope.map_or(String::new(), |p| self.trace.nodes[p].path.clone()),
                parent: scope,
                depth: self.depth_in(scope),
                input_shapes: frontier
                    .iter()
                    .map(|&p| self.trace.ports[p].shape.clone())
                    .collect(),
                output_shapes: vec![shape.clone()],
                ops,
                ..blank()
            })
        };
        for &p in &frontier {
            self.trace.uses.push((p, node));
        }
        let port = self.add_port(node, shape, None);
        self.by_id.insert(t.id(), port);
        port
    }

    fn pre(&mut self, module: &dyn Module, path: &str, input: &[Tensor]) -> Result<Vec<Tensor>> {
        let scope = self.stack.last().copied();
        let ports: Vec<usize> = input
            .iter()
            .map(|t| match self.by_id.get(&t.id()) {
                Some(&p) => p,
                None => self.untracked(t, scope),
            })
            .collect();
        let params = crate::names::named_parameters(module, &crate::names::Names::new())
            .iter()
            .map(|(_, p)| Param::elem_count(p))
            .sum();
        let node = self.add_node(DataflowNode {
            kind: NodeKind::Call,
            path: path.to_owned(),
            type_name: module.class_name(),
            parent: scope,
            depth: self.depth_in(scope),
            input_shapes: input.iter().map(|t| t.dims().to_vec()).collect(),
            params,
            ..blank()
        });
        let mut replaced = Vec::with_capacity(input.len());
        for (t, port) in input.iter().zip(ports) {
            self.trace.uses.push((port, node));
            // A tensor the walk can run through (made by tensor-level work) becomes a variable,
            // so that walks from inside this call stop at it.
            if t.is_variable() {
                replaced.push(t.clone());
            } else {
                let v = fresh_var(t)?;
                self.by_id.insert(v.id(), port);
                replaced.push(v);
            }
        }
        self.stack.push(node);
        Ok(replaced)
    }

    fn post(&mut self, output: &[Tensor]) -> Result<Vec<Tensor>> {
        let Some(node) = self.stack.pop() else {
            return Ok(output.to_vec());
        };
        self.trace.nodes[node].output_shapes = output.iter().map(|t| t.dims().to_vec()).collect();
        let mut replaced = Vec::with_capacity(output.len());
        for t in output {
            let inner = match self.by_id.get(&t.id()) {
                Some(&p) => Some(p),
                None if self.has_children[node] => Some(self.untracked(t, Some(node))),
                None => None,
            };
            let port = self.add_port(node, t.dims().to_vec(), inner);
            let v = fresh_var(t)?;
            self.by_id.insert(v.id(), port);
            replaced.push(v);
        }
        Ok(replaced)
    }

    /// Output nodes for what the outermost calls returned and nothing consumed.
    fn finish(mut self) -> Trace {
        let mut used = vec![false; self.trace.ports.len()];
        for &(p, _) in &self.trace.uses {
            used[p] = true;
        }
        let outermost: Vec<usize> = (0..self.trace.ports.len())
            .filter(|&p| {
                let producer = &self.trace.nodes[self.trace.ports[p].producer];
                !used[p] && producer.kind == NodeKind::Call && producer.parent.is_none()
            })
            .collect();
        for (k, p) in outermost.into_iter().enumerate() {
            let node = self.add_node(DataflowNode {
                kind: NodeKind::Output,
                path: k.to_string(),
                input_shapes: vec![self.trace.ports[p].shape.clone()],
                ..blank()
            });
            self.trace.uses.push((p, node));
        }
        self.trace
    }
}

fn blank() -> DataflowNode {
    DataflowNode {
        id: 0,
        kind: NodeKind::Call,
        path: String::new(),
        type_name: String::new(),
        parent: None,
        depth: 0,
        input_shapes: Vec::new(),
        output_shapes: Vec::new(),
        params: 0,
        ops: 0,
        expanded: false,
    }
}

/// A copy of `t` that is a new candle variable (a new id, where candle's graph walks stop).
fn fresh_var(t: &Tensor) -> Result<Tensor> {
    Ok(Var::from_tensor(&t.detach())?.as_tensor().clone())
}

pub fn dataflow<M: Module, R>(root: &M, run: impl FnOnce(&M) -> Result<R>) -> Result<Dataflow> {
    let hooks = Hooks::new();
    let recorder = Arc::new(Mutex::new(Recorder::default()));
    let pre = recorder.clone();
    hooks.register_global_forward_pre_hook(
        move |ctx, input| {
            let mut rec = pre.lock().unwrap_or_else(PoisonError::into_inner);
            rec.pre(ctx.module(), ctx.path(), input).map(Some)
        },
        PreHookOptions::default(),
    );
    let post = recorder.clone();
    hooks.register_global_forward_hook(
        move |_ctx, _input, output| {
            let mut rec = post.lock().unwrap_or_else(PoisonError::into_inner);
            rec.post(output).map(Some)
        },
        HookOptions::default(),
    );
    hooks.run(root, run)?;
    drop(hooks);
    let recorder = std::mem::take(&mut *recorder.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(Dataflow::view(Arc::new(recorder.finish()), None))
}
