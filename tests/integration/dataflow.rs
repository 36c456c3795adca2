//! `ModuleExt::dataflow`: nodes, edges by tensor identity and through tensor-level work, depth
//! views, DOT text and rendering.

use candle_module::digits::DigitNet;
use module_runtime::prelude::*;
use module_runtime::{Dataflow, DataflowNode, NodeKind};

/// `relu(fc2(relu(fc1(x)))) + x`: a residual around two layers, the `+` done in `forward`.
#[derive(Module)]
struct Block {
    fc1: Linear,
    fc2: Linear,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.call(x)?.relu()?;
        Ok((self.fc2.call(&h)?.relu()? + x)?)
    }
}

/// Adds its two inputs: a module-level residual, where the skip is an edge by identity.
#[derive(Module)]
struct Add {
    #[module(skip)]
    _scale: f64,
}

impl Forward<(&Tensor, &Tensor)> for Add {
    type Output = Tensor;
    fn forward(&self, (a, b): (&Tensor, &Tensor)) -> Result<Tensor> {
        Ok((a + b)?)
    }
}

#[derive(Module)]
struct Net {
    stem: Linear,
    block: Block,
    mix: Linear,
    add: Add,
    head: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let s = self.stem.call(x)?;
        let b = self.block.call(&s)?;
        let m = self.mix.call(&b)?;
        // `b` skips `mix`: the same tensor reaches `add`.
        let sum = self.add.call((&m, &b))?;
        self.head.call(&sum)
    }
}

fn net() -> Result<Net> {
    let dev = Device::Cpu;
    Ok(Net {
        stem: Linear::new(4, 8, &dev)?,
        block: Block {
            fc1: Linear::new(8, 16, &dev)?,
            fc2: Linear::new(16, 8, &dev)?,
        },
        mix: Linear::new(8, 8, &dev)?,
        add: Add { _scale: 1.0 },
        head: Linear::new(8, 3, &dev)?,
    })
}

fn graph() -> Result<Dataflow> {
    let net = net()?;
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
    net.dataflow(|m| m.call(&x))
}

/// `(from label, to label, shape)` of every edge.
fn edges(g: &Dataflow) -> Vec<(String, String, Vec<usize>)> {
    let label = |id| g.get(id).map(DataflowNode::label).unwrap();
    g.edges()
        .iter()
        .map(|e| (label(e.from), label(e.to), e.shape.clone()))
        .collect()
}

fn has_edge(g: &Dataflow, from: &str, to: &str) -> bool {
    edges(g).iter().any(|(f, t, _)| f == from && t == to)
}

#[test]
fn nodes_carry_paths_types_shapes_and_parameter_counts() -> Result<()> {
    let g = graph()?;
    let calls: Vec<_> = g
        .nodes_of(NodeKind::Call)
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        calls,
        [
            "",
            "stem",
            "block",
            "block.fc1",
            "block.fc2",
            "mix",
            "add",
            "head"
        ]
    );
    let root = g.node("").unwrap();
    assert_eq!(root.type_name, "Net");
    assert_eq!(root.depth, 0);
    assert_eq!(root.params, net()?.num_parameters());
    assert!(root.expanded);

    let fc1 = g.node("block.fc1").unwrap();
    assert_eq!(fc1.type_name, "Linear");
    assert_eq!(fc1.depth, 2);
    assert_eq!(fc1.parent, Some(g.node("block").unwrap().id));
    assert_eq!(fc1.input_shapes, [vec![2, 8]]);
    assert_eq!(fc1.output_shapes, [vec![2, 16]]);
    assert_eq!(fc1.params, 8 * 16 + 16);
    assert!(!fc1.expanded);

    let block = g.node("block").unwrap();
    assert_eq!(block.params, (8 * 16 + 16) + (16 * 8 + 8));
    let add = g.node("add").unwrap();
    assert_eq!(add.input_shapes, [vec![2, 8], vec![2, 8]]);
    assert_eq!(add.params, 0);

    let inputs: Vec<_> = g.nodes_of(NodeKind::Input).collect();
    assert_eq!(inputs.len(), 1);
    assert_eq!(inputs[0].output_shapes, [vec![2, 4]]);
    let outputs: Vec<_> = g.nodes_of(NodeKind::Output).collect();
    assert_eq!(outputs.len(), 1);
    assert_eq!(outputs[0].input_shapes, [vec![2, 3]]);
    Ok(())
}

#[test]
fn edges_follow_tensors_and_residuals_skip_blocks() -> Result<()> {
    let g = graph()?;
    let e = edges(&g);
    // The chain, leaf to leaf, through the tensor-level `relu`s.
    assert!(e.contains(&("input 0".into(), "stem: Linear".into(), vec![2, 4])));
    assert!(e.contains(&(
        "stem: Linear".into(),
        "block.fc1: Linear".into(),
        vec![2, 8]
    )));
    assert!(e.contains(&(
        "block.fc1: Linear".into(),
        "ops in block".into(),
        vec![2, 16]
    )));
    assert!(e.contains(&("head: Linear".into(), "output 0".into(), vec![2, 3])));

    // Residual through tensor-level work: `stem`'s output skips fc1 and fc2 to reach the `+`.
    assert!(has_edge(&g, "stem: Linear", "ops in block"));
    // The ops node that ends `block` (relu + add) feeds `mix`, and skips it to reach `add`: the
    // module-level residual, found by identity (`block` returned the ops node's tensor).
    let plus = g
        .nodes_of(NodeKind::Ops)
        .filter(|n| n.path == "block")
        .last()
        .unwrap();
    assert_eq!(plus.ops, 2, "relu and add");
    assert_eq!(plus.input_shapes, [vec![2, 8], vec![2, 8]]);
    let targets: Vec<_> = g
        .edges_from(plus.id)
        .map(|e| g.get(e.to).unwrap().label())
        .collect();
    assert_eq!(targets, ["mix: Linear", "add: Add"]);
    assert!(has_edge(&g, "mix: Linear", "add: Add"));
    assert!(
        !has_edge(&g, "block.fc1: Linear", "block.fc2: Linear"),
        "relu is between"
    );

    // No edge touches an expanded call.
    for e in g.edges() {
        assert!(!g.get(e.from).unwrap().expanded && !g.get(e.to).unwrap().expanded);
    }
    Ok(())
}

#[test]
fn collapse_hides_submodules_and_keeps_edges_at_their_boxes() -> Result<()> {
    let g = graph()?;
    let d1 = g.collapse(1);
    assert_eq!(d1.depth(), Some(1));
    assert!(d1.node("block.fc1").is_none());
    let block = d1.node("block").unwrap();
    assert!(!block.expanded);
    assert_eq!(
        edges(&d1),
        [
            ("input 0".into(), "stem: Linear".into(), vec![2, 4]),
            ("stem: Linear".into(), "block: Block".into(), vec![2, 8]),
            ("block: Block".into(), "mix: Linear".into(), vec![2, 8]),
            ("mix: Linear".into(), "add: Add".into(), vec![2, 8]),
            ("block: Block".into(), "add: Add".into(), vec![2, 8]),
            ("add: Add".into(), "head: Linear".into(), vec![2, 8]),
            ("head: Linear".into(), "output 0".into(), vec![2, 3]),
        ]
    );
    assert!(d1.nodes_of(NodeKind::Ops).next().is_none());

    let d0 = g.collapse(0);
    assert_eq!(
        edges(&d0),
        [
            ("input 0".into(), "Net".into(), vec![2, 4]),
            ("Net".into(), "output 0".into(), vec![2, 3]),
        ]
    );
    // Collapsing is a view: the full graph comes back.
    assert_eq!(d0.expand().edges(), g.edges());
    assert_eq!(g.collapse(5).edges(), g.edges());
    Ok(())
}

#[test]
fn digits_model_is_a_chain_with_relus_between() -> Result<()> {
    let model = DigitNet::new(&Device::Cpu)?;
    let x = Tensor::zeros((5, 64), DType::F32, &Device::Cpu)?;
    let g = model.dataflow(|m| m.call(&x))?;
    let chain: Vec<_> = edges(&g).into_iter().map(|(f, t, _)| (f, t)).collect();
    let s = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        chain,
        [
            s("input 0", "fc1: Linear"),
            s("fc1: Linear", "ops"),
            s("ops", "fc2: Linear"),
            s("fc2: Linear", "ops"),
            s("ops", "head: Linear"),
            s("head: Linear", "output 0"),
        ]
    );
    assert!(g.nodes_of(NodeKind::Ops).all(|n| n.ops == 1));
    // A trace changes nothing: the model still runs and its parameters are untouched.
    assert_eq!(model.call(&x)?.dims(), [5, 10]);
    Ok(())
}

#[test]
fn dot_text_is_well_formed() -> Result<()> {
    let g = graph()?;
    let dot = g.to_dot();
    assert!(dot.starts_with("digraph dataflow {\n"), "{dot}");
    assert!(dot.ends_with("}\n"));
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
    let root = g.node("").unwrap().id;
    let block = g.node("block").unwrap();
    let fc1 = g.node("block.fc1").unwrap().id;
    let stem = g.node("stem").unwrap().id;
    assert!(
        dot.contains(&format!("subgraph cluster_{root} {{")),
        "{dot}"
    );
    assert!(dot.contains(&format!("subgraph cluster_{} {{", block.id)));
    assert!(dot.contains("label=\"block: Block · 280 params\""), "{dot}");
    assert!(dot.contains(&format!(
        "n{fc1} [label=\"block.fc1: Linear\\n[2, 8] → [2, 16]\\n144 params\"];"
    )));
    assert!(dot.contains(&format!("n{stem} -> n{fc1} [label=\"[2, 8]\"];")));
    assert!(dot.contains("shape=note"), "ops nodes");
    assert!(dot.contains("shape=ellipse"), "inputs and outputs");
    // Collapsed: no clusters below the root, `block` is a box.
    let d1 = g.collapse(1).to_dot();
    assert!(!d1.contains(&format!("cluster_{}", block.id)));
    assert!(d1.contains(&format!("n{} [label=\"block: Block\\n", block.id)));
    // Every edge's ends are declared nodes.
    for e in g.edges() {
        assert!(
            dot.contains(&format!("  n{} [", e.from)) || dot.contains(&format!(" n{} [", e.from))
        );
        assert!(dot.contains(&format!(" n{} [", e.to)));
    }
    // Display lists the edges, each node with its id.
    let (stem, fc1) = (g.node("stem").unwrap().id, g.node("block.fc1").unwrap().id);
    let line = format!("#{stem} stem: Linear -> #{fc1} block.fc1: Linear [2, 8]");
    assert!(g.to_string().contains(&line), "{g}");
    Ok(())
}

#[test]
fn render_without_graphviz_says_what_to_install() -> Result<()> {
    let g = graph()?;
    let dir = std::env::temp_dir();
    let err = g
        .render_with(dir.join("net.svg"), "graphviz-dot-that-is-not-installed")
        .unwrap_err();
    assert!(matches!(err, Error::GraphvizNotFound { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("`graphviz-dot-that-is-not-installed` was not found on PATH"),
        "{msg}"
    );
    assert!(msg.contains("install Graphviz"), "{msg}");
    assert!(msg.contains("to_dot()"), "{msg}");
    assert!(msg.contains("net.svg"), "{msg}");

    let err = g.render(dir.join("net")).unwrap_err();
    assert!(matches!(err, Error::Render { .. }), "{err:?}");
    assert!(err.to_string().contains("no extension"), "{err}");
    Ok(())
}

#[test]
fn render_writes_the_picture_when_graphviz_is_installed() -> Result<()> {
    let g = graph()?;
    let path = std::env::temp_dir().join(format!("dataflow-test-{}.svg", std::process::id()));
    match g.render(&path) {
        Err(Error::GraphvizNotFound { .. }) => return Ok(()), // nothing to check here
        other => other?,
    }
    let svg = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    let _ = std::fs::remove_file(&path);
    assert!(svg.contains("<svg"), "{svg}");
    assert!(svg.contains("block.fc1: Linear"));
    Ok(())
}

#[test]
fn a_failing_run_returns_its_error() -> Result<()> {
    let net = net()?;
    let bad = Tensor::ones((2, 5), DType::F32, &Device::Cpu)?;
    assert!(net.dataflow(|m| m.call(&bad)).is_err());
    Ok(())
}

/// A pre-norm residual block, as `nn.TransformerEncoderLayer(norm_first=True)` writes it:
/// `x = x + f1(norm1(x)); x = x + f2(norm2(x))`. The first sum is tensor-level work that the
/// `forward` keeps and also hands to `norm2`.
#[derive(Module)]
struct PreNorm {
    norm1: Linear,
    f1: Linear,
    norm2: Linear,
    f2: Linear,
}

impl Forward<&Tensor> for PreNorm {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.f1.call(&self.norm1.call(x)?)?)?;
        Ok((&x + self.f2.call(&self.norm2.call(&x)?)?)?)
    }
}

/// Edges are exactly the tensors that flow: the second sum has two inputs, the first sum and
/// `f2`, and not also what the first sum was made from (the block's input and `f1`).
#[test]
fn a_pre_norm_residual_has_exactly_its_two_edges() -> Result<()> {
    let dev = Device::Cpu;
    let block = PreNorm {
        norm1: Linear::new(4, 4, &dev)?,
        f1: Linear::new(4, 4, &dev)?,
        norm2: Linear::new(4, 4, &dev)?,
        f2: Linear::new(4, 4, &dev)?,
    };
    let x = Tensor::ones((2, 4), DType::F32, &dev)?;
    let g = block.dataflow(|m| m.call(&x))?;
    let ops: Vec<&DataflowNode> = g.nodes_of(NodeKind::Ops).collect();
    assert_eq!(ops.len(), 2, "{g}");
    let (first, second) = (ops[0].id, ops[1].id);
    let from = |id: usize| -> Vec<String> {
        g.edges_to(id)
            .map(|e| g.get(e.from).unwrap().label())
            .collect()
    };
    assert_eq!(from(first), ["input 0", "f1: Linear"], "{g}");
    assert_eq!(from(second), ["ops", "f2: Linear"], "{g}");
    assert!(g.edges_to(second).any(|e| e.from == first), "{g}");
    assert_eq!(ops[1].input_shapes.len(), 2);
    // The first sum feeds `norm2` and the second sum: two edges out.
    let to: Vec<String> = g
        .edges_from(first)
        .map(|e| g.get(e.to).unwrap().label())
        .collect();
    assert_eq!(to, ["norm2: Linear", "ops"], "{g}");
    // The text listing tells the two ops nodes apart by id.
    let text = g.to_string();
    assert!(
        text.contains(&format!("#{first} ops -> #{second} ops [2, 4]")),
        "{text}"
    );
    Ok(())
}

/// Masked mean pooling over a sequence: `sum(h * mask) / sum(mask)`, the mask handed to the model
/// as floats. The mask has an edge into the pooling ops, beside the encoder's output.
#[derive(Module)]
struct MaskedPool {
    encoder: Linear,
}

impl Forward<(&Tensor, &Tensor)> for MaskedPool {
    type Output = Tensor;
    fn forward(&self, (x, mask): (&Tensor, &Tensor)) -> Result<Tensor> {
        let h = self.encoder.call(x)?;
        let m = mask.unsqueeze(2)?;
        Ok((h.broadcast_mul(&m)?.sum(1)?.broadcast_div(&m.sum(1)?))?)
    }
}

#[test]
fn a_float_mask_flows_into_masked_pooling() -> Result<()> {
    let dev = Device::Cpu;
    let model = MaskedPool {
        encoder: Linear::new(4, 6, &dev)?,
    };
    let x = Tensor::ones((2, 5, 4), DType::F32, &dev)?;
    let mask = Tensor::new(&[[1f32, 1., 1., 0., 0.], [1., 1., 1., 1., 1.]], &dev)?;
    let g = model.dataflow(|m| m.call((&x, &mask)))?;
    let pool = g.nodes_of(NodeKind::Ops).last().unwrap();
    let mut from: Vec<String> = g
        .edges_to(pool.id)
        .map(|e| format!("{} {:?}", g.get(e.from).unwrap().label(), e.shape))
        .collect();
    from.sort();
    assert_eq!(from, ["encoder: Linear [2, 5, 6]", "input 1 [2, 5]"], "{g}");
    Ok(())
}
