//! `#[derive(TensorStruct)]`: structs of tensors as a module's input and output through `call`,
//! with hooks seeing and replacing their tensors.

use std::sync::{Arc, Mutex};

use module_runtime::prelude::*;
use module_runtime::{TensorStruct, TensorTree};

/// Named fields: a tensor, an optional tensor, a nested derived struct, a `Vec` of tensors, and a
/// skipped plain value.
#[derive(TensorStruct, Debug)]
struct Batch {
    images: Tensor,
    mask: Option<Tensor>,
    extra: Pair,
    #[tensor(skip)]
    ids: Vec<String>,
    features: Vec<Tensor>,
}

/// A tuple struct, also a leaf-less plain value in field 1 (`usize` is a tree without tensors).
#[derive(TensorStruct, Debug)]
struct Pair(Tensor, usize, (Tensor, f32));

/// A generic struct: `T` must be a tensor tree, the skipped `U` need not be.
#[derive(TensorStruct)]
struct Tagged<T, U> {
    value: T,
    #[tensor(skip)]
    tag: U,
}

/// A unit struct: no tensors.
#[derive(TensorStruct)]
struct Nothing;

/// Not a tensor tree: only usable when skipped.
#[derive(Debug, PartialEq)]
struct Meta {
    step: u32,
}

#[derive(TensorStruct)]
struct WithMeta {
    x: Tensor,
    #[tensor(skip)]
    meta: Meta,
}

fn t(values: &[f32]) -> Tensor {
    Tensor::new(values, &Device::Cpu).unwrap()
}

fn batch() -> Batch {
    Batch {
        images: t(&[1., 2.]),
        mask: Some(t(&[3.])),
        extra: Pair(t(&[4.]), 7, (t(&[5.]), 0.5)),
        ids: vec!["a".into(), "b".into()],
        features: vec![t(&[6.]), t(&[7.])],
    }
}

fn values(tree: &impl TensorTree) -> Vec<Vec<f32>> {
    tree.tensors()
        .iter()
        .map(|t| t.to_vec1::<f32>().unwrap())
        .collect()
}

#[test]
fn derived_tensor_struct_walks_fields_in_order_and_keeps_skipped_values() {
    let b = batch();
    assert_eq!(b.tensor_count(), 6);
    assert_eq!(
        values(&b),
        [
            vec![1., 2.],
            vec![3.],
            vec![4.],
            vec![5.],
            vec![6.],
            vec![7.]
        ]
    );
    let doubled = b.map_tensors(&mut |t| (t * 2.).unwrap());
    assert_eq!(
        values(&doubled),
        [
            vec![2., 4.],
            vec![6.],
            vec![8.],
            vec![10.],
            vec![12.],
            vec![14.]
        ]
    );
    assert_eq!(doubled.ids, ["a", "b"]);
    assert_eq!(doubled.extra.1, 7);
    assert_eq!(doubled.extra.2 .1, 0.5);

    let tagged = Tagged {
        value: (t(&[1.]), Some(t(&[2.]))),
        tag: Meta { step: 3 },
    };
    assert_eq!(tagged.tensor_count(), 2);
    let tagged = tagged.map_tensors(&mut |t| t.neg().unwrap());
    assert_eq!(values(&tagged.value), [vec![-1.], vec![-2.]]);
    assert_eq!(tagged.tag, Meta { step: 3 });
    assert_eq!(Nothing.tensor_count(), 0);
}

/// A model taking and returning derived structs.
#[derive(Module)]
struct Scale {
    scale: Param,
}

impl Forward<Batch> for Scale {
    type Output = WithMeta;

    fn forward(&self, b: Batch) -> Result<WithMeta> {
        let s = self.scale.tensor()?;
        let mut x = b.images.broadcast_mul(&s)?;
        if let Some(m) = &b.mask {
            x = x.broadcast_add(m)?;
        }
        x = x.broadcast_add(&b.extra.0)?;
        Ok(WithMeta {
            x,
            meta: Meta {
                step: b.ids.len() as u32,
            },
        })
    }
}

/// The tensors of a derived struct reach hooks in field order (PyTorch hooks get the positional
/// args and the output; here the struct's tensors), and a hook may replace them: the module then
/// runs on the rebuilt struct, with skipped fields unchanged.
#[test]
fn derived_structs_flow_through_call_and_hooks_replace_their_tensors() -> Result<()> {
    let model = Scale {
        scale: Param::new(t(&[10.]))?,
    };
    let hooks = Hooks::new();
    let seen: Arc<Mutex<Vec<Vec<Vec<f32>>>>> = Arc::default();
    let sink = seen.clone();
    hooks.register_forward_pre_hook(
        "",
        move |_, input| {
            sink.lock()
                .unwrap()
                .push(input.iter().map(|t| t.to_vec1::<f32>().unwrap()).collect());
            // Replace the mask (the second tensor) and keep the rest.
            let mut new = input.to_vec();
            new[1] = t(&[100.]);
            Ok(Some(new))
        },
        PreHookOptions::default(),
    )?;
    let sink = seen.clone();
    hooks.register_forward_hook(
        "",
        move |_, input, output| {
            sink.lock()
                .unwrap()
                .push(vec![vec![input.len() as f32, output.len() as f32]]);
            Ok(Some(vec![output[0].neg()?]))
        },
        HookOptions::default(),
    )?;
    let out = hooks.run(&model, |m| m.call(batch()))?;
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0][0], [1., 2.]);
    assert_eq!(seen[0][1], [3.]);
    assert_eq!(seen[1], [vec![6., 1.]]);
    // (images * 10 + 100 + 4), negated by the forward hook.
    assert_eq!(out.x.to_vec1::<f32>()?, [-114., -124.]);
    assert_eq!(out.meta, Meta { step: 2 });

    // Without hooks, `call` is `forward`.
    let plain = model.call(batch())?;
    assert_eq!(plain.x.to_vec1::<f32>()?, [17., 27.]);
    Ok(())
}

/// A hook handing back the wrong number of tensors for a derived struct is a typed error.
#[test]
fn hook_returning_too_few_tensors_for_a_derived_struct_is_an_error() -> Result<()> {
    let model = Scale {
        scale: Param::new(t(&[1.]))?,
    };
    let hooks = Hooks::new();
    hooks.register_forward_pre_hook(
        "",
        |_, input| Ok(Some(input[..2].to_vec())),
        PreHookOptions::default(),
    )?;
    let result = hooks.run(&model, |m| m.call(batch()));
    assert!(
        matches!(result, Err(Error::HookTensorCount { .. })),
        "{:?}",
        result.err()
    );
    Ok(())
}
