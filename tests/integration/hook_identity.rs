//! How hooks find the module a call is a call of: by identity, resolved when the hooks are attached
//! and again when the registry or the tree changes during a run (hooks registered or removed, a
//! `Lazy` cell built), with modules shared through `Arc`, temporaries and nested runs.

use std::sync::{Arc, Mutex};

use module_runtime::nn::Linear;
use module_runtime::prelude::*;
use module_runtime::HookCtx;

fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

fn x() -> Result<Tensor> {
    Ok(Tensor::ones((1, 3), DType::F32, &dev())?)
}

type Log = Arc<Mutex<Vec<String>>>;

fn take(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

/// A forward hook that logs `name` and the path it fired at.
fn logging(
    log: &Log,
    name: &'static str,
) -> impl Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync + 'static
{
    let log = log.clone();
    move |ctx, _, _| {
        log.lock().unwrap().push(format!("{name}@{}", ctx.path()));
        Ok(None)
    }
}

/// Calls `fc` twice.
#[derive(Module)]
struct Twice {
    fc: Linear,
}

impl Forward<&Tensor> for Twice {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc.call(x)?;
        self.fc.call(&h)
    }
}

fn twice() -> Result<Twice> {
    Ok(Twice {
        fc: Linear::new(3, 3, &dev())?,
    })
}

#[test]
fn a_hook_registered_during_a_run_fires_from_the_next_call() -> Result<()> {
    let m = twice()?;
    let hooks = Hooks::new();
    let log: Log = Arc::default();
    // The first `fc` call registers `late` on `fc` and removes itself: `late` fires at the second.
    let registry = hooks.clone();
    let sink = log.clone();
    hooks.register_forward_hook(
        "fc",
        move |ctx, _, _| {
            sink.lock().unwrap().push("first".into());
            registry.register_forward_hook("fc", logging(&sink, "late"), HookOptions::default())?;
            ctx.remove_this_hook();
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.run(&m, |m| m.call(&x()?))?;
    assert_eq!(take(&log), ["first", "late@fc"]);
    hooks.run(&m, |m| m.call(&x()?))?;
    assert_eq!(take(&log), ["late@fc", "late@fc"]);
    Ok(())
}

#[test]
fn a_hook_removed_by_its_handle_during_a_run_stops_from_the_next_call() -> Result<()> {
    let m = twice()?;
    let hooks = Hooks::new();
    let log: Log = Arc::default();
    let target =
        hooks.register_forward_hook("fc", logging(&log, "target"), HookOptions::default())?;
    // A global hook removes it at the first `fc` call: it still fires in that call, not after.
    hooks.register_global_forward_hook(
        move |ctx, _, _| {
            if ctx.path() == "fc" {
                target.remove();
            }
            Ok(None)
        },
        HookOptions::default(),
    );
    hooks.run(&m, |m| m.call(&x()?))?;
    assert_eq!(take(&log), ["target@fc"]);
    assert_eq!(hooks.len(), 1);
    Ok(())
}

#[derive(Module)]
struct Block {
    fc: Linear,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc.call(x)
    }
}

/// One block shared as `a` and `b`, called through each `Arc` and through a plain reference.
#[derive(Module)]
struct SharedBlocks {
    a: Arc<Block>,
    b: Arc<Block>,
}

impl Forward<&Tensor> for SharedBlocks {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.a.call(x)?;
        let h = self.b.call(&h)?;
        // The block itself, not an `Arc` field: its first path.
        let block: &Block = &self.b;
        block.call(&h)
    }
}

fn shared_blocks() -> Result<SharedBlocks> {
    let block = Arc::new(Block {
        fc: Linear::new(3, 3, &dev())?,
    });
    Ok(SharedBlocks {
        a: block.clone(),
        b: block,
    })
}

#[test]
fn a_shared_module_and_its_submodules_report_the_path_they_were_called_through() -> Result<()> {
    let m = shared_blocks()?;
    let (_, order) = m.call_order(|m| m.call(&x()?))?;
    assert_eq!(order, ["", "a", "a.fc", "b", "b.fc", "a", "a.fc"]);
    // A hook on `b.fc` is on the module, which is also `a.fc`: it fires at every call of it.
    let hooks = Hooks::new();
    let log: Log = Arc::default();
    hooks.register_forward_hook("b.fc", logging(&log, "fc"), HookOptions::default())?;
    hooks.run(&m, |m| m.call(&x()?))?;
    assert_eq!(take(&log), ["fc@a.fc", "fc@b.fc", "fc@a.fc"]);
    Ok(())
}

#[test]
fn hooks_are_given_the_module_inside_a_box_or_an_arc() -> Result<()> {
    #[derive(Module)]
    struct Holders {
        boxed: Box<Linear>,
        shared: Arc<Linear>,
    }
    impl Forward<&Tensor> for Holders {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = self.boxed.call(x)?;
            self.shared.call(&h)
        }
    }
    let m = Holders {
        boxed: Box::new(Linear::new(3, 3, &dev())?),
        shared: Arc::new(Linear::new(3, 2, &dev())?),
    };
    let hooks = Hooks::new();
    let log: Log = Arc::default();
    let sink = log.clone();
    hooks.register_global_forward_hook(
        move |ctx, _, _| {
            if let Some(fc) = ctx.module().downcast_ref::<Linear>() {
                sink.lock()
                    .unwrap()
                    .push(format!("{}:{}", ctx.path(), fc.out_features()));
            }
            Ok(None)
        },
        HookOptions::default(),
    );
    hooks.run(&m, |m| m.call(&x()?))?;
    assert_eq!(take(&log), ["boxed:3", "shared:2"]);
    Ok(())
}

/// Calls a `Linear` it builds on the fly (not part of the tree), then its own.
#[derive(Module)]
struct WithTemporary {
    fc: Linear,
}

impl Forward<&Tensor> for WithTemporary {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let temporary = Linear::new(3, 3, x.device())?;
        let h = temporary.call(x)?;
        self.fc.call(&h)
    }
}

#[test]
fn a_temporary_module_runs_without_hooks() -> Result<()> {
    let m = WithTemporary {
        fc: Linear::new(3, 3, &dev())?,
    };
    let (_, order) = m.call_order(|m| m.call(&x()?))?;
    assert_eq!(order, ["", "fc"]);
    Ok(())
}

#[test]
fn a_nested_run_on_another_root_has_its_own_paths_until_it_returns() -> Result<()> {
    let m = shared_blocks()?;
    let outer = Hooks::new();
    let log: Log = Arc::default();
    outer.register_global_forward_hook(logging(&log, "outer"), HookOptions::default());
    let inner = Hooks::new();
    inner.register_global_forward_hook(logging(&log, "inner"), HookOptions::default());
    outer.run(&m, |m| {
        // The block as a root of its own: paths from it, and only the inner hooks fire.
        inner.run(&*m.a, |block| block.call(&x()?))?;
        m.a.call(&x()?)
    })?;
    assert_eq!(take(&log), ["inner@fc", "inner@", "outer@a.fc", "outer@a"]);
    Ok(())
}

/// A module that builds its state (with a submodule) on its first input, like `lazy.rs`'s.
#[derive(Module)]
struct Adaptive {
    state: Lazy<AdaptiveState>,
}

#[derive(Module)]
struct AdaptiveState {
    proj: Linear,
}

impl Build<&Tensor> for Adaptive {
    type State = AdaptiveState;
    fn state(&self) -> &Lazy<AdaptiveState> {
        &self.state
    }
    fn build_state(&self, x: &Tensor) -> Result<AdaptiveState> {
        let width = x.dim(D::Minus1)?;
        Ok(AdaptiveState {
            proj: Linear::new(width, 2, x.device())?,
        })
    }
}

impl Forward<&Tensor> for Adaptive {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.built(x)?.proj.call(x)
    }
}

#[test]
fn a_lazy_cell_built_during_a_run_joins_the_hooked_tree() -> Result<()> {
    let m = Adaptive { state: Lazy::new() };
    // Unbuilt when the hooks are attached: `state.proj` does not exist yet.
    let (_, order) = m.call_order(|m| {
        m.call(&x()?)?;
        m.call(&x()?)
    })?;
    assert_eq!(order, ["", "state.proj", "", "state.proj"]);
    let (_, captured) = m.capture(&["state.proj"], |m| m.call(&x()?))?;
    assert_eq!(captured.get("state.proj").unwrap().dims(), [1, 2]);
    Ok(())
}

#[test]
fn a_lazy_cell_built_on_another_thread_during_a_run_joins_the_hooked_tree() -> Result<()> {
    let m = Arc::new(Adaptive { state: Lazy::new() });
    let (_, order) = m.call_order(|m| {
        let other = m.clone();
        std::thread::spawn(move || other.call(&x()?).map(drop))
            .join()
            .unwrap()?;
        m.call(&x()?)
    })?;
    assert_eq!(order, ["", "state.proj"]);
    Ok(())
}
