use module_runtime::nn::{LayerNorm, Linear};
use module_runtime::{HookOptions, Hooks, Module};

#[derive(Module)]
#[module(paths)]
struct Net {
    fc: Linear,
    norm: LayerNorm,
}

fn main() {
    let hooks = Hooks::new();
    let _ = hooks.register_typed_forward_hook(&Net::path().fc(), |_ctx, _m: &LayerNorm, _, _| {
        Ok(None)
    }, HookOptions::default());
}
