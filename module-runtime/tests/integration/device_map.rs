//! Device maps and offload (`nn::big_modeling`): a model split over stand-in devices (one real
//! CPU under several names) computes what the unmapped model computes, keeps its state dict, and
//! moves activations exactly where the placement changes; `cpu` and `disk` offload read each
//! weight per call and keep none; `infer_auto_device_map` fills devices by budget; bad maps are
//! typed errors that leave the model as it was.

use std::path::PathBuf;

use module_runtime::nn::big_modeling::{
    dispatch_model, infer_auto_device_map, DeviceMap, MaxMemory, Move, Placement,
};
use module_runtime::nn::{Embedding, LayerNorm};
use module_runtime::prelude::*;
use module_runtime::{DeviceMapError, HookOptions, Hooks};

#[derive(Module)]
struct Block {
    fc: Linear,
    norm: LayerNorm,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.norm.call(&self.fc.call(x)?.relu()?)?;
        Ok((x + h)?)
    }
}

#[derive(Module)]
struct Net {
    embed: Embedding,
    layers: Vec<Block>,
    head: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut h = self.embed.call(ids)?;
        for layer in &self.layers {
            h = layer.call(&h)?;
        }
        self.head.call(&h)
    }
}

const WIDTH: usize = 16;

fn net() -> Result<Net> {
    seeded(7)
}

/// A model and an unmapped copy of it (the generator is the process's, shared by the tests
/// running at once, so a seed alone does not give two equal models).
fn pair() -> Result<(Net, Net)> {
    let (model, reference) = (net()?, net()?);
    reference.load_state_dict(&model.state_dict()?, &LoadOptions::default())?;
    Ok((model, reference))
}

fn seeded(seed: u64) -> Result<Net> {
    manual_seed(seed);
    let dev = Device::Cpu;
    Ok(Net {
        embed: Embedding::new(50, WIDTH, &dev)?,
        layers: (0..4)
            .map(|_| {
                Ok(Block {
                    fc: Linear::new(WIDTH, WIDTH, &dev)?,
                    norm: LayerNorm::new(WIDTH, &dev)?,
                })
            })
            .collect::<Result<_>>()?,
        head: Linear::new(WIDTH, 10, &dev)?,
    })
}

fn ids() -> Result<Tensor> {
    Ok(Tensor::new(
        &[[1u32, 5, 9, 42], [3, 3, 0, 49]],
        &Device::Cpu,
    )?)
}

fn gpu(n: usize) -> Placement {
    Placement::stand_in(format!("gpu{n}"), &Device::Cpu)
}

fn folder(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("device-map-{name}-{}", std::process::id()))
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

fn mv(path: &str, from: &str, to: &str, tensors: usize) -> Move {
    Move {
        path: path.into(),
        from: from.into(),
        to: to.into(),
        tensors,
    }
}

/// Two stand-in devices: the output is the unmapped model's bit for bit, and activations move
/// at the three boundaries (into gpu0, gpu0 → gpu1, back to the caller), nowhere else.
#[test]
fn a_split_over_stand_in_devices_computes_the_same_and_moves_at_boundaries() -> Result<()> {
    let (model, reference) = pair()?;
    let expected = reference.call(&ids()?)?;
    let map = DeviceMap::new()
        .insert("embed", gpu(0))?
        .insert("layers.0", gpu(0))?
        .insert("layers.1", gpu(0))?
        .insert("layers.*", gpu(1))?
        .insert("head", gpu(1))?;
    let dispatched = dispatch_model(&model, &map)?;
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&expected)?);
    assert_eq!(
        dispatched.trace().moves(),
        [
            mv("embed", "cpu", "gpu0", 1),
            mv("layers.2", "gpu0", "gpu1", 1),
            mv("", "gpu1", "cpu", 1),
        ]
    );
    // The first matching entry names `layers.0` and `layers.1`, the pattern the rest.
    let placed: Vec<(&str, &str)> = dispatched
        .hf_device_map()
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_str()))
        .collect();
    assert_eq!(
        placed,
        [
            ("embed", "gpu0"),
            ("layers.0", "gpu0"),
            ("layers.1", "gpu0"),
            ("layers.2", "gpu1"),
            ("layers.3", "gpu1"),
            ("head", "gpu1")
        ]
    );
    // The state dict: the same keys in the same order, the same values.
    let (sd, expected_sd) = (model.state_dict()?, reference.state_dict()?);
    let keys: Vec<&str> = sd.keys().collect();
    assert_eq!(keys, expected_sd.keys().collect::<Vec<_>>());
    for key in keys {
        assert_eq!(
            values(sd.get(key).unwrap())?,
            values(expected_sd.get(key).unwrap())?,
            "{key}"
        );
    }
    Ok(())
}

/// A placed module inside another placed on another device: its inputs move in and its output
/// moves back out to the enclosing module's device.
#[test]
fn a_nested_placement_moves_in_and_back_out() -> Result<()> {
    let (model, reference) = pair()?;
    let map = DeviceMap::new()
        .insert("", gpu(0))?
        .insert("layers.1.fc", gpu(1))?;
    let dispatched = dispatch_model(&model, &map)?;
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&reference.call(&ids()?)?)?);
    assert_eq!(
        dispatched.trace().moves(),
        [
            mv("", "cpu", "gpu0", 1),
            mv("layers.1.fc", "gpu0", "gpu1", 1),
            mv("layers.1.fc", "gpu1", "gpu0", 1),
            mv("", "gpu0", "cpu", 1),
        ]
    );
    Ok(())
}

/// Hooks of the user's own still fire on a dispatched model, at the same paths.
#[test]
fn the_users_hooks_and_paths_are_unchanged() -> Result<()> {
    let model = net()?;
    let map = DeviceMap::from_pairs([("embed", "cpu"), ("layers", "cpu"), ("head", "cpu")])?;
    let dispatched = dispatch_model(&model, &map.insert("layers.3", gpu(1))?)?;
    let hooks = Hooks::new();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    hooks.register_forward_hook(
        "layers.*.norm",
        move |ctx, _, _| {
            log.lock().unwrap().push(ctx.path().to_owned());
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.run(&model, |_| dispatched.call(&ids()?))?;
    let expected: Vec<String> = (0..4).map(|i| format!("layers.{i}.norm")).collect();
    assert_eq!(*seen.lock().unwrap(), expected);
    Ok(())
}

/// Disk offload: the offloaded weights leave the model (it keeps only their shapes), each call
/// reads every one of them once, the outputs and state dict are the unmapped model's, and a load
/// into the mapped model writes the files (the weights stay on disk).
#[test]
fn disk_offload_reads_each_weight_per_call_and_keeps_none() -> Result<()> {
    let (model, reference) = pair()?;
    let dir = folder("disk");
    let map = DeviceMap::from_pairs([("embed", "cpu"), ("layers.*", "disk"), ("head", "cpu")])?
        .offload_folder(&dir);
    let dispatched = dispatch_model(&model, &map)?;
    let offloaded: Vec<(String, Param)> = model
        .named_parameters()
        .into_iter()
        .filter(|(p, _)| p.starts_with("layers."))
        .collect();
    assert_eq!(offloaded.len(), 16);
    for (path, p) in &offloaded {
        assert!(p.is_offloaded(), "{path}");
        assert!(dir.join(format!("{path}.safetensors")).is_file(), "{path}");
        assert_eq!(p.shape(), reference.get_parameter(path)?.shape());
    }
    assert!(!model.head.weight.is_offloaded());
    let before = dispatched.trace().loads();
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&reference.call(&ids()?)?)?);
    assert_eq!(
        dispatched.trace().loads() - before,
        16,
        "one read per weight per call"
    );
    dispatched.call(&ids()?)?;
    assert_eq!(dispatched.trace().loads() - before, 32);
    assert_eq!(
        dispatched.trace().bytes_loaded(),
        2 * 4 * (WIDTH * WIDTH + 3 * WIDTH) * 4
    );
    // No move: every module computes on the CPU.
    assert_eq!(dispatched.trace().moves(), []);
    let sd = model.state_dict()?;
    for (key, t) in reference.state_dict()?.iter() {
        assert_eq!(values(sd.get(key).unwrap())?, values(t)?, "{key}");
    }
    // Loading new weights writes them to the files; the model stays offloaded.
    let other = seeded(99)?;
    model.load_state_dict(&other.state_dict()?, &LoadOptions::default())?;
    assert!(model.layers[2].fc.weight.is_offloaded());
    assert_eq!(
        values(&dispatched.call(&ids()?)?)?,
        values(&other.call(&ids()?)?)?
    );
    // A map putting everything back on the device brings the weights back.
    dispatch_model(&model, &DeviceMap::from_pairs([("", "cpu")])?)?;
    assert!(!model.layers[2].fc.weight.is_offloaded());
    assert_eq!(
        values(&model.call(&ids()?)?)?,
        values(&other.call(&ids()?)?)?
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// CPU offload with a (stand-in) accelerator computing: the `cpu` weights are copied to it on
/// each read, and the activations move as for a device.
#[test]
fn cpu_offload_copies_each_weight_to_the_execution_device() -> Result<()> {
    let (model, reference) = pair()?;
    let map = DeviceMap::new()
        .insert("embed", gpu(0))?
        .insert("layers", Placement::Cpu)?
        .insert("head", gpu(0))?;
    assert_eq!(map.main_device().name(), "gpu0");
    let dispatched = dispatch_model(&model, &map)?;
    assert!(model.layers[0].fc.weight.is_offloaded());
    assert_eq!(
        model.layers[0].fc.weight.offload_location().as_deref(),
        Some("cpu")
    );
    assert!(!model.embed.weight.is_offloaded());
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&reference.call(&ids()?)?)?);
    assert_eq!(dispatched.trace().loads(), 16);
    // `layers` computes on the execution device, gpu0: no move between embed and head.
    assert_eq!(
        dispatched.trace().moves(),
        [mv("embed", "cpu", "gpu0", 1), mv("", "gpu0", "cpu", 1)]
    );
    Ok(())
}

/// `infer_auto_device_map`: whole layers in order, each device filled to its budget, the rest on
/// disk; without disk, the first unit that fits nowhere is named.
#[test]
fn auto_fills_devices_in_order_by_budget() -> Result<()> {
    let model = net()?;
    let layer = (WIDTH * WIDTH + 3 * WIDTH) * 4; // fc.weight, fc.bias, norm.weight, norm.bias
    let embed = 50 * WIDTH * 4;
    let budget = MaxMemory::new()
        .placement(gpu(0), embed + 2 * layer)
        .placement(gpu(1), layer + layer / 2)
        .offload_to_disk();
    let map = infer_auto_device_map(&model, &budget, &["layers.*"])?;
    let entries: Vec<(&str, &str)> = map.entries().map(|(p, d)| (p, d.name())).collect();
    assert_eq!(
        entries,
        [
            ("embed", "gpu0"),
            ("layers.0", "gpu0"),
            ("layers.1", "gpu0"),
            ("layers.2", "gpu1"),
            ("layers.3", "disk"),
            ("head", "disk"),
        ]
    );
    let dir = folder("auto");
    let (_, reference) = pair()?;
    reference.load_state_dict(&model.state_dict()?, &LoadOptions::default())?;
    let dispatched = dispatch_model(&model, &map.offload_folder(&dir))?;
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&reference.call(&ids()?)?)?);
    std::fs::remove_dir_all(&dir).ok();
    // Without `no_split`, a block is split into its layers to fill gpu0 further.
    let budget =
        MaxMemory::new().placement(gpu(0), embed + 2 * layer + WIDTH * WIDTH * 4 + WIDTH * 4);
    let err = infer_auto_device_map(&reference, &budget, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::DeviceMap(DeviceMapError::NoRoom { path, .. }) if path == "layers.2.norm"),
        "{err}"
    );
    Ok(())
}

/// Every bad map is a typed error naming what is wrong, and the model is left as it was.
#[test]
fn bad_maps_are_typed_errors_and_change_nothing() -> Result<()> {
    let model = net()?;
    let dir = folder("bad");
    let uncovered = dispatch_model(
        &model,
        &DeviceMap::from_pairs([("embed", "cpu"), ("head", "cpu")])?,
    )
    .unwrap_err();
    match &uncovered {
        Error::DeviceMap(DeviceMapError::Uncovered { paths }) => {
            assert!(
                paths.contains(&"layers.{0..3}.fc.weight".to_owned()),
                "{paths:?}"
            )
        }
        e => panic!("{e}"),
    }
    let typo = dispatch_model(
        &model,
        &DeviceMap::from_pairs([("", "cpu"), ("layer.*", "disk")])?,
    )
    .unwrap_err();
    assert!(
        matches!(&typo, Error::NoModuleMatch { pattern, .. } if pattern == "layer.*"),
        "{typo}"
    );
    let unknown = DeviceMap::from_pairs([("embed", "tpu:0")]).unwrap_err();
    assert!(
        matches!(&unknown, Error::DeviceMap(DeviceMapError::UnknownDevice { pattern, name, .. })
            if pattern == "embed" && name == "tpu:0"),
        "{unknown}"
    );
    // A `no_split` module placed over two devices.
    let split = DeviceMap::new()
        .insert("", gpu(0))?
        .insert("layers.1.norm", gpu(1))?
        .no_split("layers.*")?;
    let err = dispatch_model(&model, &split).unwrap_err();
    assert!(
        matches!(&err, Error::DeviceMap(DeviceMapError::Split { path, .. }) if path == "layers.1"),
        "{err}"
    );
    assert!(
        err.to_string().contains("`layers.1.norm.weight` on gpu1"),
        "{err}"
    );
    let no_folder = dispatch_model(
        &model,
        &DeviceMap::from_pairs([("", "cpu"), ("head", "disk")])?,
    )
    .unwrap_err();
    assert!(
        matches!(&no_folder, Error::DeviceMap(DeviceMapError::NoOffloadFolder { pattern }) if pattern == "head"),
        "{no_folder}"
    );
    // A quantized weight cannot go to disk; the checks run before any file is written.
    let quantized = Linear::new(32, 4, &Device::Cpu)?;
    quantized.weight.quantize(GgmlDType::Q8_0)?;
    let map = DeviceMap::from_pairs([("", "disk")])?.offload_folder(&dir);
    let err = dispatch_model(&quantized, &map).unwrap_err();
    assert!(
        matches!(&err, Error::DeviceMap(DeviceMapError::NotOffloadable { path, .. }) if path == "weight"),
        "{err}"
    );
    assert!(!dir.exists());
    assert!(!quantized.bias.as_ref().unwrap().is_offloaded());
    for (path, p) in model.named_parameters() {
        assert!(!p.is_offloaded(), "{path}");
    }
    Ok(())
}

/// A weight tied between two modules placed on two devices is refused, naming both paths.
#[test]
fn a_tied_weight_placed_apart_is_refused() -> Result<()> {
    #[derive(Module)]
    struct Tied {
        a: Linear,
        b: Linear,
    }
    let a = Linear::new(4, 4, &Device::Cpu)?;
    let b = Linear::from_params(a.weight.clone(), None);
    let model = Tied { a, b };
    let map = DeviceMap::new().insert("a", gpu(0))?.insert("b", gpu(1))?;
    let err = dispatch_model(&model, &map).unwrap_err();
    match &err {
        Error::DeviceMap(DeviceMapError::Split { path, placements }) => {
            assert_eq!(path, "a.weight");
            assert_eq!(placements[1], ("b.weight".to_owned(), "gpu1".to_owned()));
        }
        e => panic!("{e}"),
    }
    // Together they are fine.
    let map = DeviceMap::new().insert("a", gpu(1))?.insert("b", gpu(1))?;
    dispatch_model(&model, &map)?;
    Ok(())
}

/// A model built empty (`build_empty`) dispatched onto a folder an earlier dispatch wrote takes
/// its files: its weights are never in memory, and it computes what the written model did. A
/// missing file is named.
#[test]
fn an_empty_model_takes_the_files_of_an_earlier_dispatch() -> Result<()> {
    let (written, reference) = pair()?;
    let dir = folder("empty");
    let map = DeviceMap::from_pairs([("", "cpu"), ("layers", "disk")])?.offload_folder(&dir);
    dispatch_model(&written, &map)?;
    let empty = build_empty(net)?;
    assert!(!empty.layers[0].fc.weight.is_built());
    let missing = dispatch_model(
        &empty,
        &DeviceMap::from_pairs([("", "disk")])?.offload_folder(&dir),
    )
    .unwrap_err();
    assert!(
        matches!(&missing, Error::DeviceMap(DeviceMapError::NotOffloadable { path, .. }) if path == "embed.weight"),
        "{missing}"
    );
    assert!(
        !empty.layers[0].fc.weight.is_built(),
        "a refused map changes nothing"
    );
    // The rest loaded as usual, the layers from the folder.
    let sd = written.state_dict()?;
    let mut outside = StateDict::new();
    for (key, t) in sd.iter().filter(|(k, _)| !k.starts_with("layers.")) {
        outside.insert(key, t.clone());
    }
    empty.load_state_dict(&outside, &LoadOptions::default().non_strict())?;
    let dispatched = dispatch_model(&empty, &map)?;
    assert!(empty.layers[0].fc.weight.is_offloaded() && empty.layers[0].fc.weight.is_built());
    assert_eq!(empty.layers[0].fc.weight.shape().dims(), [WIDTH, WIDTH]);
    let y = dispatched.call(&ids()?)?;
    assert_eq!(values(&y)?, values(&reference.call(&ids()?)?)?);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// Quantizing an offloaded weight brings it back, quantized; `to_device`/`to_dtype` leave an
/// offloaded weight where it is kept.
#[test]
fn an_offloaded_weight_quantized_or_moved() -> Result<()> {
    let layer = Linear::new(32, 4, &Device::Cpu)?;
    let before = layer.weight.tensor()?;
    let map = DeviceMap::new()
        .insert("", gpu(0))?
        .execution_device(gpu(0));
    let map = map.insert("", Placement::Cpu)?;
    let dispatched = dispatch_model(&layer, &map)?;
    assert_eq!(
        dispatched.hf_device_map(),
        [("".to_owned(), "gpu0".to_owned())]
    );
    // The first entry for the root wins: gpu0, nothing offloaded.
    assert!(!layer.weight.is_offloaded());
    let map = DeviceMap::new()
        .insert("", Placement::Cpu)?
        .execution_device(gpu(0));
    dispatch_model(&layer, &map)?;
    assert!(layer.weight.is_offloaded());
    layer.to_dtype(DType::F64)?;
    assert_eq!(layer.weight.dtype(), DType::F32);
    assert_eq!(layer.bias.as_ref().unwrap().dtype(), DType::F32);
    layer.weight.quantize(GgmlDType::Q8_0)?;
    assert!(!layer.weight.is_offloaded() && layer.weight.is_quantized());
    let err = (layer.weight.tensor()? - before)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(err < 0.05, "{err}");
    Ok(())
}
