//! The everyday `nn.Module` API a PyTorch user reaches for (issue 14, item 2), each behaviour
//! checked against PyTorch's source. Unless said otherwise, the functions cited are in
//! `torch/nn/modules/module.py` of the PyTorch repository.

use std::sync::Arc;

use module_runtime::prelude::*;
use module_runtime::Names;

fn names<T>(list: Vec<(String, T)>) -> Vec<String> {
    list.into_iter().map(|(n, _)| n).collect()
}

fn ones(n: usize) -> Param {
    Param::new(Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// A block with a parameter and a buffer of its own, and a submodule.
#[derive(Module)]
struct Block {
    gain: Param,
    steps: Buffer,
    fc: Linear,
}

fn block() -> Block {
    Block {
        gain: ones(2),
        steps: Buffer::new(Tensor::new(0i64, &Device::Cpu).unwrap()),
        fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
    }
}

/// A model sharing one block under two paths (`Arc`) and tying one parameter twice.
#[derive(Module)]
struct Shared {
    scale: Param,
    tied: Param,
    a: Arc<Block>,
    b: Arc<Block>,
}

fn shared() -> Shared {
    let scale = ones(1);
    let block = Arc::new(block());
    Shared {
        tied: scale.clone(),
        scale,
        a: block.clone(),
        b: block,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. prefix / recurse / remove_duplicate
// ---------------------------------------------------------------------------------------------

/// `Module._named_members`: `name = module_prefix + ("." if module_prefix else "") + k`, over
/// `self.named_modules(prefix=prefix, ...)`, so every name starts with `prefix.`.
#[test]
fn named_members_prefix_joins_with_a_dot() {
    let m = block();
    assert_eq!(
        names(m.named_parameters_with(&Names::new().prefix("model"))),
        ["model.gain", "model.fc.weight", "model.fc.bias"]
    );
    assert_eq!(
        names(m.named_buffers_with(&Names::new().prefix("model"))),
        ["model.steps"]
    );
    // An empty prefix gives the bare names, as `named_parameters()` does.
    assert_eq!(
        names(m.named_parameters_with(&Names::new().prefix(""))),
        names(m.named_parameters())
    );
}

/// `Module.named_modules`: `yield prefix, self` first, then children under
/// `prefix + ("." if prefix else "") + name`: with a prefix, the root is named by the prefix.
#[test]
fn named_modules_with_prefix_names_the_root_by_the_prefix() {
    let m = block();
    assert_eq!(
        names(m.named_modules_with(&Names::new().prefix("model"))),
        ["model", "model.fc"]
    );
    assert_eq!(names(m.named_modules_with(&Names::new())), ["", "fc"]);
}

/// `Module._named_members` with `recurse=False` lists `[(prefix, self)]` only: the module's own,
/// direct parameters and buffers.
#[test]
fn recurse_false_lists_only_own_parameters_and_buffers() {
    let m = block();
    let own = Names::new().recurse(false);
    assert_eq!(names(m.named_parameters_with(&own)), ["gain"]);
    assert_eq!(names(m.named_buffers_with(&own)), ["steps"]);
    assert_eq!(
        names(m.named_parameters_with(&own.clone().prefix("blk"))),
        ["blk.gain"]
    );
    // A module with no parameters of its own lists none, however many its children have.
    let s = shared();
    assert_eq!(names(s.a.named_buffers_with(&own)), ["steps"]);
    #[derive(Module)]
    struct Wrapper {
        inner: Block,
    }
    let w = Wrapper { inner: block() };
    assert!(w.named_parameters_with(&own).is_empty());
    assert!(w.named_buffers_with(&own).is_empty());
}

/// `Module.named_modules(remove_duplicate=False)` does not add modules to `memo`, and
/// `_named_members(remove_duplicate=False)` does not add members: every alias is listed.
#[test]
fn keep_duplicates_lists_every_alias() {
    let s = shared();
    assert_eq!(
        names(s.named_parameters()),
        ["scale", "a.gain", "a.fc.weight", "a.fc.bias"]
    );
    assert_eq!(
        names(s.named_parameters_with(&Names::new().keep_duplicates())),
        [
            "scale",
            "tied",
            "a.gain",
            "a.fc.weight",
            "a.fc.bias",
            "b.gain",
            "b.fc.weight",
            "b.fc.bias"
        ]
    );
    // The older spelling stays.
    assert_eq!(
        names(s.named_parameters_with_aliases()),
        names(s.named_parameters_with(&Names::new().keep_duplicates()))
    );
    assert_eq!(names(s.named_buffers()), ["a.steps"]);
    assert_eq!(
        names(s.named_buffers_with(&Names::new().keep_duplicates())),
        ["a.steps", "b.steps"]
    );
    assert_eq!(names(s.named_modules()), ["", "a", "a.fc"]);
    assert_eq!(
        names(s.named_modules_with(&Names::new().keep_duplicates().prefix("m"))),
        ["m", "m.a", "m.a.fc", "m.b", "m.b.fc"]
    );
    // Own members only, each alias: the tied parameter twice.
    assert_eq!(
        names(s.named_parameters_with(&Names::new().recurse(false).keep_duplicates())),
        ["scale", "tied"]
    );
    assert_eq!(
        names(s.named_parameters_with(&Names::new().recurse(false))),
        ["scale"]
    );
}

/// The defaults are PyTorch's: `prefix=""`, `recurse=True`, `remove_duplicate=True`
/// (`Module.named_parameters`, `Module.named_buffers`, `Module.named_modules`).
#[test]
fn default_names_are_the_plain_views() {
    let s = shared();
    let d = Names::default();
    assert_eq!(d, Names::new());
    assert!(d.is_recursive() && d.removes_duplicates() && d.get_prefix().is_empty());
    assert_eq!(
        names(s.named_parameters_with(&d)),
        names(s.named_parameters())
    );
    assert_eq!(names(s.named_buffers_with(&d)), names(s.named_buffers()));
    assert_eq!(names(s.named_modules_with(&d)), names(s.named_modules()));
}
