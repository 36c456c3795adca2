//! Typed paths (`#[module(paths)]`): for every container kind, the string form of a typed path is
//! the runtime's path (as `named_modules` / `named_parameters` list it), and `get` finds the value
//! there, as its own type.

use std::collections::BTreeMap;
use std::sync::Arc;

use module_runtime::nn::{LayerNorm, ModuleDict, ModuleList, Sequential};
use module_runtime::prelude::*;
use module_runtime::typed_path::{Checked, Each, Shared, Static, TypedPath};
use module_runtime::PathExt;

#[derive(Module)]
#[module(paths)]
struct Block {
    #[module(rename = "LayerNorm")]
    norm: LayerNorm,
    fc: Linear,
}

#[derive(Module)]
#[module(paths)]
struct Pair(Linear, Linear);

#[derive(Module)]
#[module(paths)]
struct Inner {
    proj: Linear,
}

#[derive(Module)]
#[module(paths)]
enum Head {
    Plain(Linear),
    Gated { gate: Linear, out: Linear },
}

#[derive(Module)]
#[module(paths)]
struct Net {
    blocks: Vec<Block>,
    array: [Linear; 2],
    list: ModuleList<Linear>,
    seq: Sequential,
    dict: ModuleDict<Linear>,
    map: BTreeMap<String, Block>,
    head: Option<Linear>,
    absent: Option<Linear>,
    boxed: Box<Block>,
    shared_a: Arc<Block>,
    shared_b: Arc<Block>,
    tuple: (Linear, Block),
    pair: Pair,
    #[module(flatten)]
    inner: Inner,
    gated: Head,
    plain: Head,
    #[module(skip)]
    _config: usize,
    width: usize,
}

fn lin() -> Linear {
    Linear::new(2, 2, &Device::Cpu).unwrap()
}

fn block() -> Block {
    Block {
        norm: LayerNorm::new(2, &Device::Cpu).unwrap(),
        fc: lin(),
    }
}

fn net() -> Net {
    let mut seq = Sequential::new();
    seq.push(lin());
    seq.add_module("named", lin()).unwrap();
    let mut list = ModuleList::new();
    list.push(lin());
    let mut dict = ModuleDict::new();
    dict.insert("a", lin()).unwrap();
    let mut map = BTreeMap::new();
    map.insert("k".to_owned(), block());
    let shared = Arc::new(block());
    Net {
        blocks: vec![block(), block()],
        array: [lin(), lin()],
        list,
        seq,
        dict,
        map,
        head: Some(lin()),
        absent: None,
        boxed: Box::new(block()),
        shared_a: shared.clone(),
        shared_b: shared,
        tuple: (lin(), block()),
        pair: Pair(lin(), lin()),
        inner: Inner { proj: lin() },
        gated: Head::Gated {
            gate: lin(),
            out: lin(),
        },
        plain: Head::Plain(lin()),
        _config: 0,
        width: 2,
    }
}

/// The path is listed by the runtime (as a module or a parameter).
fn listed(net: &Net, path: &str) -> bool {
    let with_aliases = module_runtime::Names::new().keep_duplicates();
    net.named_modules_with(&with_aliases)
        .iter()
        .any(|(p, _)| p == path)
        || net
            .named_parameters_with(&module_runtime::Names::new().keep_duplicates())
            .iter()
            .any(|(p, _)| p == path)
}

#[test]
fn strings_are_the_runtime_paths() {
    let net = net();
    let p = Net::path;
    let paths: Vec<String> = vec![
        p().blocks().to_string(),
        p().blocks().at(1).norm().to_string(),
        p().blocks().at(0).norm().weight().to_string(),
        p().blocks().at(1).fc().bias().to_string(),
        p().array().at(1).to_string(),
        p().list().at(0).weight().to_string(),
        p().seq().at(0).to_string(),
        p().seq().named("named").to_string(),
        p().seq().named("named").of::<Linear>().weight().to_string(),
        p().dict().key("a").weight().to_string(),
        p().map().key("k").norm().to_string(),
        p().head().to_string(),
        p().head().weight().to_string(),
        p().boxed().fc().to_string(),
        p().shared_a().fc().to_string(),
        p().tuple()._0().to_string(),
        p().tuple()._1().norm().to_string(),
        p().pair()._1().to_string(),
        p().inner().proj().to_string(),
        p().gated().gated_gate().to_string(),
        p().plain().plain().weight().to_string(),
    ];
    let expected = [
        "blocks",
        "blocks.1.LayerNorm",
        "blocks.0.LayerNorm.weight",
        "blocks.1.fc.bias",
        "array.1",
        "list.0.weight",
        "seq.0",
        "seq.named",
        "seq.named.weight",
        "dict.a.weight",
        "map.k.LayerNorm",
        "head",
        "head.weight",
        "boxed.fc",
        "shared_a.fc",
        "tuple.0",
        "tuple.1.LayerNorm",
        "pair.1",
        "proj",
        "gated.gate",
        "plain.weight",
    ];
    assert_eq!(paths, expected);
    for path in &paths {
        assert!(listed(&net, path), "`{path}` is not a runtime path");
    }
    // The second alias of a shared module is not a state-dict path (its first path is), but it
    // reaches the same module.
    let b = p().shared_b().fc();
    assert_eq!(b.as_str(), "shared_b.fc");
    let a: &Linear = net.get(p().shared_a().fc());
    assert!(std::ptr::eq(a, net.get(b)));
    // Patterns.
    assert_eq!(p().blocks().each().fc().as_str(), "blocks.*.fc");
    assert_eq!(p().map().each().norm().as_str(), "map.*.LayerNorm");
    assert_eq!(p().seq().each().as_str(), "seq.*");
    // The root is the empty path.
    assert_eq!(p().as_str(), "");
}

#[test]
fn get_returns_the_concrete_type() {
    let net = net();
    let p = Net::path;
    // Static: no `Option`.
    let root: &Net = net.get(p());
    assert_eq!(root.width, 2);
    let fc: &Linear = net.get(p().boxed().fc());
    assert!(std::ptr::eq(fc, &net.boxed.fc));
    let norm: &LayerNorm = net.get(p().tuple()._1().norm());
    assert!(std::ptr::eq(norm, &net.tuple.1.norm));
    let weight: &Param = net.get(p().inner().proj().weight());
    assert!(std::ptr::eq(weight, &net.inner.proj.weight));
    let blocks: &Vec<Block> = net.get(p().blocks());
    assert_eq!(blocks.len(), 2);
    // Checked: indices, keys, `Option`, enum variants.
    assert!(net.get(p().blocks().at(1).fc()).is_some());
    assert!(net.get(p().blocks().at(2).fc()).is_none());
    assert!(net.get(p().dict().key("a")).is_some());
    assert!(net.get(p().dict().key("b")).is_none());
    assert!(net.get(p().map().key("k").fc()).is_some());
    assert!(net.get(p().head()).is_some());
    assert!(net.get(p().absent()).is_none());
    assert!(net.get(p().seq().named("named").of::<Linear>()).is_some());
    assert!(net.get(p().seq().at(0).of::<LayerNorm>()).is_none());
    assert!(net.get(p().gated().gated_out()).is_some());
    assert!(net.get(p().gated().plain()).is_none());
    assert!(net.get(p().plain().plain()).is_some());
    assert!(net.get(p().plain().gated_gate()).is_none());
    assert!(net.get(p().head().bias()).is_some());
    // Each: every match.
    let fcs: Vec<&Linear> = net.get(p().blocks().each().fc());
    assert_eq!(fcs.len(), 2);
    assert_eq!(net.get(p().array().each()).len(), 2);
    // `PathExt::get` works on any root, through the generic path types too.
    let list: &ModuleList<Linear> = net.get(p().list());
    assert!(std::ptr::eq(list, &net.list));
    let _: Option<&Linear> = PathExt::get(&net, p().list().at(0));
}

#[test]
fn kinds_are_tracked_in_the_types() {
    fn kind<P: TypedPath>(_: &P) -> &'static str {
        std::any::type_name::<P::Kind>()
    }
    let p = Net::path;
    assert_eq!(kind(&p().boxed().fc()), std::any::type_name::<Static>());
    assert_eq!(
        kind(&p().blocks().at(0).fc()),
        std::any::type_name::<Checked>()
    );
    assert_eq!(
        kind(&p().blocks().each().fc()),
        std::any::type_name::<Each>()
    );
    assert_eq!(kind(&p().head()), std::any::type_name::<Checked>());
    // Past a flattened field, the kind is the parent's again.
    assert_eq!(kind(&p().inner().proj()), std::any::type_name::<Static>());
    // Through an `Arc`: `Shared` (`get` as the inner kind, no `get_mut`).
    assert_eq!(
        kind(&p().shared_a().fc()),
        std::any::type_name::<Shared<Static>>()
    );
}

#[test]
fn typed_paths_are_accepted_where_strings_are() -> Result<()> {
    let net = net();
    // freeze / unfreeze take `&str`: a typed path dereferences to one.
    let every_fc = Net::path().blocks().each().fc();
    assert_eq!(net.freeze(&every_fc)?, 4);
    assert_eq!(net.unfreeze(&every_fc)?, 4);
    // capture takes `&[&str]`.
    let x = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
    let first = Net::path().blocks().at(0).fc();
    let (_, captured) = net.capture(&[&first, &every_fc], |n| n.blocks[0].fc.call(&x))?;
    assert!(captured.get("blocks.0.fc").is_some());
    // Hooks: a string hook and a typed hook, which sees the module as its own type.
    let hooks = Hooks::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let _h = hooks.register_forward_hook(&every_fc, |_, _, _| Ok(None), HookOptions::default())?;
    let _t = hooks.register_typed_forward_hook(
        &first,
        move |ctx, fc: &Linear, _, _| {
            log.lock()
                .unwrap()
                .push((ctx.path().to_owned(), fc.weight.tensor()?.dims().to_vec()));
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.run(&net, |n| n.blocks[0].fc.call(&x))?;
    assert_eq!(
        *seen.lock().unwrap(),
        [("blocks.0.fc".to_owned(), vec![2, 2])]
    );
    Ok(())
}

/// A module whose call returns two tensors, to see a typed tuple output in a hook.
#[derive(Module)]
#[module(paths)]
struct Split {
    fc: Linear,
}

impl Forward<&Tensor> for Split {
    type Output = (Tensor, Tensor);
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let y = self.fc.call(x)?;
        Ok((y.clone(), y.neg()?))
    }
}

#[derive(Module)]
#[module(paths)]
struct Outer {
    split: Split,
}

impl Forward<&Tensor> for Outer {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (a, b) = self.split.call(x)?;
        Ok((a + b)?)
    }
}

#[test]
fn typed_output_hooks_see_and_replace_the_modules_own_output_type() -> Result<()> {
    let dev = Device::Cpu;
    let outer = Outer {
        split: Split {
            fc: Linear::new(3, 2, &dev)?,
        },
    };
    let x = Tensor::ones((1, 3), DType::F32, &dev)?;
    let hooks = Hooks::new();
    let path = Outer::path().split();
    // The first hook replaces the second tensor of the tuple by zeros...
    hooks.register_typed_output_hook(
        &path,
        |ctx, split: &Split, out: &(Tensor, Tensor)| {
            assert_eq!(ctx.path(), "split");
            assert_eq!(out.0.dim(1)?, split.fc.out_features());
            Ok(Some((out.0.clone(), out.1.zeros_like()?)))
        },
        HookOptions::default(),
    )?;
    // ...and the next one sees that replacement as a typed value.
    hooks.register_typed_output_hook(
        &path,
        |_, _: &Split, out: &(Tensor, Tensor)| {
            assert_eq!(out.1.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    let y = hooks.run(&outer, |m| m.call(&x))?;
    let first = outer.split.fc.call(&x)?;
    assert_eq!(y.to_vec2::<f32>()?, first.to_vec2::<f32>()?);

    // A hook for another output type is an error naming the path and the type it takes.
    let wrong = Hooks::new();
    wrong.register_typed_output_hook(
        &Outer::path().split(),
        |_, _: &Split, _: &Tensor| Ok(None),
        HookOptions::default(),
    )?;
    let err = wrong.run(&outer, |m| m.call(&x)).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("`split`"), "{message}");
    assert!(message.contains("Tensor"), "{message}");
    Ok(())
}

/// A module taking borrowed tensors and a plain value: a typed hook sees their owned form.
#[derive(Module)]
#[module(paths)]
struct Gate {
    fc: Linear,
}

impl Forward<(&Tensor, Option<&Tensor>, f64)> for Gate {
    type Output = Tensor;
    fn forward(&self, (x, mask, scale): (&Tensor, Option<&Tensor>, f64)) -> Result<Tensor> {
        let y = (self.fc.call(x)? * scale)?;
        Ok(match mask {
            Some(m) => (y * m)?,
            None => y,
        })
    }
}

/// A struct input of one's own; `Clone`, so typed hooks see it.
#[derive(TensorStruct, Clone)]
struct Batch {
    x: Tensor,
    #[tensor(skip)]
    tag: &'static str,
}

/// The same without `Clone`: a typed hook cannot be given a copy.
#[derive(TensorStruct)]
struct Opaque {
    x: Tensor,
}

#[derive(Module)]
#[module(paths)]
struct Takes {
    fc: Linear,
}

impl Forward<Batch> for Takes {
    type Output = Tensor;
    fn forward(&self, b: Batch) -> Result<Tensor> {
        self.fc.call(&b.x)
    }
}

impl Forward<Opaque> for Takes {
    type Output = Tensor;
    fn forward(&self, b: Opaque) -> Result<Tensor> {
        self.fc.call(&b.x)
    }
}

#[derive(Module)]
#[module(paths)]
struct Host {
    gate: Gate,
    takes: Takes,
    attn: module_runtime::nn::MultiheadAttention,
}

impl Forward<&Tensor> for Host {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mask = x.ones_like()?;
        let a = self.gate.call((x, Some(&mask), 2.0))?;
        let b = self.takes.call(Batch {
            x: x.clone(),
            tag: "batch",
        })?;
        let (c, _) = self
            .attn
            .call(module_runtime::nn::AttentionInput::new(x, x, x))?;
        Ok(((a + b)? + c.sum_keepdim(1)?.broadcast_as((1, 3))?)?)
    }
}

fn host() -> Result<Host> {
    let dev = Device::Cpu;
    Ok(Host {
        gate: Gate {
            fc: Linear::new(3, 3, &dev)?,
        },
        takes: Takes {
            fc: Linear::new(3, 3, &dev)?,
        },
        attn: module_runtime::nn::MultiheadAttention::new(3, 1, &dev)?,
    })
}

#[test]
fn typed_hooks_see_the_modules_own_input_type() -> Result<()> {
    use module_runtime::nn::{MultiheadAttention, OwnedAttentionInput};
    use std::sync::atomic::{AtomicUsize, Ordering};

    let host = host()?;
    let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
    let hooks = Hooks::new();
    let seen = Arc::new(AtomicUsize::new(0));
    // A module called with `&Tensor`: the hook reads a `&Tensor` (the owned form, borrowed).
    let count = seen.clone();
    let want = x.clone();
    hooks.register_typed_hook(
        &Host::path().gate().fc(),
        move |ctx, fc: &Linear, input: &Tensor, out: &Tensor| {
            assert_eq!(ctx.path(), "gate.fc");
            assert_eq!(ctx.input_type(), std::any::type_name::<&Tensor>());
            assert_eq!(input.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
            assert_eq!(out.dim(1)?, fc.out_features());
            count.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    // Borrowed tensors inside a tuple are owned; plain values are copied.
    let count = seen.clone();
    hooks.register_typed_hook(
        &Host::path().gate(),
        move |_, _: &Gate, input: &(Tensor, Option<Tensor>, f64), _: &Tensor| {
            let (x, mask, scale) = input;
            assert_eq!(x.dims(), [1, 3]);
            assert!(mask.is_some());
            assert_eq!(*scale, 2.0);
            count.fetch_add(1, Ordering::SeqCst);
            // Replace the output: zeros.
            Ok(Some(x.zeros_like()?))
        },
        HookOptions::default(),
    )?;
    // A `Clone` struct input is given as itself.
    let count = seen.clone();
    hooks.register_typed_hook(
        &Host::path().takes(),
        move |_, _: &Takes, input: &Batch, _: &Tensor| {
            assert_eq!(input.tag, "batch");
            assert_eq!(input.x.dims(), [1, 3]);
            count.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    // The runtime's attention input is given as its owned twin.
    let count = seen.clone();
    hooks.register_typed_hook(
        &Host::path().attn(),
        move |_,
              _: &MultiheadAttention,
              input: &OwnedAttentionInput,
              out: &(Tensor, Option<Tensor>)| {
            assert_eq!(input.query.dims(), [1, 3]);
            assert!(input.key_padding_mask.is_none() && input.need_weights);
            assert_eq!(input.as_input().key.dims(), [1, 3]);
            assert!(out.1.is_some());
            count.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    let hooked = hooks.run(&host, |m| m.call(&x))?;
    assert_eq!(seen.load(Ordering::SeqCst), 4);

    // The replaced output of `gate` (zeros) is what the model used.
    let b = host.takes.fc.call(&x)?;
    let (c, _) = host
        .attn
        .call(module_runtime::nn::AttentionInput::new(&x, &x, &x))?;
    let expected = (b + c.sum_keepdim(1)?.broadcast_as((1, 3))?)?;
    let diff = (hooked - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "{diff}");
    Ok(())
}

#[test]
fn typed_hooks_see_the_input_a_pre_hook_replaced() -> Result<()> {
    let host = host()?;
    let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
    let hooks = Hooks::new();
    let fc = Host::path().gate().fc();
    hooks.register_forward_pre_hook(
        &fc,
        |_, input| Ok(Some(vec![input[0].zeros_like()?])),
        PreHookOptions::default(),
    )?;
    hooks.register_typed_hook(
        &fc,
        |_, _: &Linear, input: &Tensor, _: &Tensor| {
            assert_eq!(input.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.run(&host, |m| m.call(&x))?;
    Ok(())
}

#[test]
fn typed_hooks_for_another_input_type_fail_naming_the_types() -> Result<()> {
    let host = host()?;
    let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
    // `gate` is called with a tuple, not a tensor.
    let hooks = Hooks::new();
    hooks.register_typed_hook(
        &Host::path().gate(),
        |_, _: &Gate, _: &Tensor, _: &Tensor| Ok(None),
        HookOptions::default(),
    )?;
    let err = hooks.run(&host, |m| m.call(&x)).unwrap_err();
    let Error::Hook { path, source, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(path, "gate");
    let Error::HookInputType {
        expected, found, ..
    } = source.as_ref()
    else {
        panic!("{err}")
    };
    assert!(expected.contains("Tensor"), "{expected}");
    assert!(found.starts_with("(&"), "{found}");

    // A struct input that is not `Clone` gives no copy: the same error, naming the struct.
    let opaque = Hooks::new();
    opaque.register_typed_hook(
        &Takes::path(),
        |_, _: &Takes, _: &Opaque, _: &Tensor| Ok(None),
        HookOptions::default(),
    )?;
    let input = Opaque { x: x.clone() };
    let err = opaque.run(&host.takes, |m| m.call(input)).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("Opaque"), "{message}");
    assert!(message.contains("clone_tree"), "{message}");
    Ok(())
}

#[test]
fn get_mut_returns_the_concrete_type_mutably_for_every_kind() {
    let mut net = net();
    let p = Net::path;
    // Static: `&mut T`, at the module `get` finds.
    let boxed_fc: *const Linear = &net.boxed.fc;
    let fc: &mut Linear = net.get_mut(p().boxed().fc());
    assert!(std::ptr::eq(fc, boxed_fc));
    fc.bias = None;
    assert!(net.boxed.fc.bias.is_none());
    let root: &mut Net = net.get_mut(p());
    root.width = 3;
    assert_eq!(net.width, 3);
    let weight: *const Param = &net.inner.proj.weight;
    assert!(std::ptr::eq(
        net.get_mut(p().inner().proj().weight()),
        weight
    ));
    let norm: *const LayerNorm = &net.tuple.1.norm;
    assert!(std::ptr::eq(net.get_mut(p().tuple()._1().norm()), norm));

    // Checked: `Option<&mut T>`, `None` where the index, key, `Option` or variant is not there.
    let second: *const Linear = &net.blocks[1].fc;
    let fc = net
        .get_mut(p().blocks().at(1).fc())
        .expect("block 1 exists");
    assert!(std::ptr::eq(fc, second));
    fc.bias = None;
    assert!(net.blocks[1].fc.bias.is_none() && net.blocks[0].fc.bias.is_some());
    assert!(net.get_mut(p().blocks().at(2).fc()).is_none());
    assert!(net.get_mut(p().dict().key("a")).is_some());
    assert!(net.get_mut(p().dict().key("b")).is_none());
    assert!(net.get_mut(p().map().key("k").norm()).is_some());
    assert!(net.get_mut(p().head()).is_some());
    assert!(net.get_mut(p().absent()).is_none());
    assert!(net
        .get_mut(p().seq().named("named").of::<Linear>())
        .is_some());
    assert!(net.get_mut(p().seq().at(0).of::<LayerNorm>()).is_none());
    assert!(net.get_mut(p().gated().gated_out()).is_some());
    assert!(net.get_mut(p().gated().plain()).is_none());
    assert!(net.get_mut(p().plain().plain()).is_some());

    // Each: every match at once, each a distinct module.
    let fcs: Vec<&mut Linear> = net.get_mut(p().blocks().each().fc());
    assert_eq!(fcs.len(), 2);
    for fc in fcs {
        fc.bias = None;
    }
    assert!(net.blocks.iter().all(|b| b.fc.bias.is_none()));
    let array: Vec<&mut Linear> = net.get_mut(p().array().each());
    assert_eq!(array.len(), 2);
    assert!(!std::ptr::eq(&*array[0], &*array[1]));
    // Through the generic path types of the runtime's containers, with `PathExt`.
    let first: *const Linear = &net.list[0];
    let got = PathExt::get_mut(&mut net, p().list().at(0));
    assert!(std::ptr::eq(got.expect("element 0 exists"), first));
    // A path through an `Arc` still has `get` (its kind is `Shared<_>`); `get_mut` does not
    // compile for it (a UI case in module-derive).
    let shared: &Block = net.get(p().shared_b());
    assert!(std::ptr::eq(shared, &*net.shared_a));
}

/// A map key is one path segment, so a typed path's string is the runtime's path: keys that are
/// empty or hold `.` (PyTorch's `add_module` raises `KeyError`) or `*` (a pattern's wildcard) are
/// refused where they enter, naming the key (and the path, where it is known).
#[test]
fn keys_that_are_not_path_segments_are_refused() -> Result<()> {
    let mut dict = ModuleDict::new();
    for bad in ["", "a.b", "*", "a*"] {
        match dict.insert(bad, lin()) {
            Err(Error::InvalidKey {
                container: "ModuleDict",
                key,
                ..
            }) => assert_eq!(key, bad),
            other => panic!("{bad:?}: {:?}", other.map(|_| ())),
        }
    }
    assert!(dict.is_empty());

    // A `BTreeMap`'s keys enter through `std`: the state dict and loads refuse them.
    let mut net = net();
    net.map.insert("bad.key".to_owned(), block());
    let err = net.state_dict().unwrap_err();
    let Error::InvalidKey {
        container,
        path,
        key,
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (*container, path.as_str(), key.as_str()),
        ("BTreeMap", "map", "bad.key")
    );
    assert!(err.to_string().contains("\"bad.key\" at `map`"), "{err}");
    let good = net_state()?;
    assert!(matches!(
        net.load_state_dict(&good, &LoadOptions::default()),
        Err(Error::InvalidKey { .. })
    ));

    // With valid keys, a key's typed path is the runtime's path, and `key("*")` is no pattern.
    let net = self::net();
    let k = Net::path().map().key("k").fc();
    assert_eq!(k.as_str(), "map.k.fc");
    assert!(listed(&net, &k));
    assert!(net.get(Net::path().map().key("*")).is_none());
    assert!(net.get(Net::path().dict().key("*")).is_none());
    assert_eq!(net.get(Net::path().map().each()).len(), 1);
    Ok(())
}

fn net_state() -> Result<StateDict> {
    net().state_dict()
}
