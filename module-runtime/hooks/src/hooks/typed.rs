//! Typed hooks: registered on a [`TypedPath`]. Forward hooks are given the module (and its input
//! and output) as their own types, each a [`Hooks::register_forward_hook`] underneath, taking the
//! same [`HookOptions`]; backward hooks have their path checked.

use candle_core::Tensor;

use super::hook::{BackwardHookCtx, BackwardHookOptions, HookCtx, HookHandle, HookOptions};
use super::registry::Hooks;
use crate::error::{Error, Result};
use crate::tensor_tree::TensorTree;
use crate::typed_path::TypedPath;

impl Hooks {
    /// [`register_forward_hook`](Hooks::register_forward_hook) on a typed path, with the
    /// module given to the hook as its own type: `|ctx, attn: &BertSelfAttention, input, output|`.
    /// A hook whose module type is not the path's target does not compile.
    pub fn register_typed_forward_hook<P: TypedPath>(
        &self,
        path: &P,
        hook: impl Fn(&HookCtx<'_>, &P::Target, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
            + Send
            + Sync
            + 'static,
        options: HookOptions,
    ) -> Result<HookHandle> {
        let hook = move |ctx: &HookCtx<'_>, input: &[Tensor], output: &[Tensor]| {
            match (ctx.module() as &dyn std::any::Any).downcast_ref::<P::Target>() {
                Some(module) => hook(ctx, module, input, output),
                // A path through an `Arc` alias or a `Sequential` cast can reach another type.
                None => Err(Error::WrongModuleType {
                    path: ctx.path().to_owned(),
                    expected: std::any::type_name::<P::Target>().to_owned(),
                    found: ctx.module().type_name().to_owned(),
                }),
            }
        };
        self.register_forward_hook(path.as_str(), hook, options)
    }
}

impl Hooks {
    /// A forward hook on a typed path that sees the module *and its output* as their own types —
    /// `|ctx, attn: &BertSelfAttention, out: &Tensor|`, or a tuple, or a
    /// [`TensorStruct`](crate::TensorStruct) — and may return a replacement output of that type
    /// (`Ok(Some(new))`). The module's type is checked at compile time; the output type at run
    /// time, since a module may implement `Forward` for several inputs: a call that returns
    /// another type is [`Error::HookOutputType`].
    ///
    /// For the input typed as well, see [`register_typed_hook`](Hooks::register_typed_hook).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::HookOptions;
    ///
    /// #[derive(Module)]
    /// #[module(paths)]
    /// struct Net {
    ///     fc: Linear,
    /// }
    ///
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
    ///         self.fc.call(x)
    ///     }
    /// }
    ///
    /// let net = Net { fc: Linear::new(3, 2, &Device::Cpu)? };
    /// let hooks = Hooks::new();
    /// hooks.register_typed_output_hook(&Net::path().fc(), |_, fc: &Linear, out: &Tensor| {
    ///     assert_eq!(out.dim(1)?, fc.out_features());
    ///     Ok(Some(out.zeros_like()?)) // replace the output
    /// }, HookOptions::default())?;
    /// let y = hooks.run(&net, |m| m.call(&Tensor::ones((1, 3), DType::F32, &Device::Cpu)?))?;
    /// assert_eq!(y.to_vec2::<f32>()?, [[0.0, 0.0]]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn register_typed_output_hook<P, O>(
        &self,
        path: &P,
        hook: impl Fn(&HookCtx<'_>, &P::Target, &O) -> Result<Option<O>> + Send + Sync + 'static,
        options: HookOptions,
    ) -> Result<HookHandle>
    where
        P: TypedPath,
        O: TensorTree + 'static,
    {
        let hook = move |ctx: &HookCtx<'_>, module: &P::Target, _: &[Tensor], _: &[Tensor]| {
            Ok(hook(ctx, module, typed_output(ctx)?)?.map(|new| new.tensors()))
        };
        self.register_typed_forward_hook(path, hook, options)
    }

    /// A forward hook on a typed path that sees the module, *its input* and its output as their
    /// own types, and may return a replacement output: PyTorch's `register_forward_hook(hook)`
    /// with `hook(module, args, output)`, typed.
    ///
    /// The input is given in its owned form ([`TensorTree::Owned`]),
    /// since `forward` has consumed the input by the time the hook runs: a module called with a
    /// `&Tensor` gives the hook a `&Tensor` to read (the owned form `Tensor`, borrowed), one called
    /// with `(&Tensor, Option<&Tensor>)` gives `&(Tensor, Option<Tensor>)`, a
    /// [`MultiheadAttention`](../module_runtime/nn/struct.MultiheadAttention.html) an
    /// [`OwnedAttentionInput`](../module_runtime/nn/struct.OwnedAttentionInput.html). Making it clones the input's
    /// tensors' handles (no data) in the calls of hooked modules only; a call without forward
    /// hooks pays nothing.
    ///
    /// The module's type is checked at compile time, and so is that the input type is an owned
    /// form (a hook taking `&&Tensor` does not compile). Which input and output types a call
    /// has is known only at run time, since a module may implement `Forward` for several inputs:
    /// a call whose owned input is another type is [`Error::HookInputType`],
    /// and one whose output is another type [`Error::HookOutputType`].
    /// A [`TensorStruct`](crate::TensorStruct) input is given when the struct is `Clone`
    /// (see [`clone_tree`](crate::TensorStruct::clone_tree)).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::HookOptions;
    ///
    /// #[derive(Module)]
    /// #[module(paths)]
    /// struct Net {
    ///     fc: Linear,
    /// }
    ///
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
    ///         self.fc.call(x)
    ///     }
    /// }
    ///
    /// let net = Net { fc: Linear::new(3, 2, &Device::Cpu)? };
    /// let hooks = Hooks::new();
    /// // `fc` is called with a `&Tensor`: the hook reads it as a `&Tensor` too.
    /// hooks.register_typed_hook(&Net::path().fc(), |_, fc: &Linear, x: &Tensor, y: &Tensor| {
    ///     assert_eq!(x.dim(1)?, fc.in_features());
    ///     Ok(Some((y + x.sum_keepdim(1)?.broadcast_as(y.shape())?)?)) // a residual of sorts
    /// }, HookOptions::default())?;
    /// let x = Tensor::ones((1, 3), DType::F32, &Device::Cpu)?;
    /// let hooked = hooks.run(&net, |m| m.call(&x))?;
    /// let plain = net.call(&x)?;
    /// // (y + 3) - y is 3 up to rounding, as y is random.
    /// let diff = (hooked - plain)?.to_vec2::<f32>()?;
    /// assert!(diff[0].iter().all(|d| (d - 3.0).abs() < 1e-5), "{diff:?}");
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn register_typed_hook<P, I, O>(
        &self,
        path: &P,
        hook: impl Fn(&HookCtx<'_>, &P::Target, &I, &O) -> Result<Option<O>> + Send + Sync + 'static,
        options: HookOptions,
    ) -> Result<HookHandle>
    where
        P: TypedPath,
        I: TensorTree<Owned = I> + 'static,
        O: TensorTree + 'static,
    {
        let hook = move |ctx: &HookCtx<'_>, module: &P::Target, _: &[Tensor], _: &[Tensor]| {
            let Some(input) = ctx.input::<I>() else {
                return Err(Error::HookInputType {
                    path: ctx.path().to_owned(),
                    expected: std::any::type_name::<I>().to_owned(),
                    found: ctx.input_type().to_owned(),
                });
            };
            Ok(hook(ctx, module, input, typed_output(ctx)?)?.map(|new| new.tensors()))
        };
        self.register_typed_forward_hook(path, hook, options)
    }
}

/// The output of the call a typed forward hook runs in, as an `O`.
fn typed_output<'a, O: 'static>(ctx: &'a HookCtx<'_>) -> Result<&'a O> {
    ctx.output::<O>().ok_or_else(|| Error::HookOutputType {
        path: ctx.path().to_owned(),
        expected: std::any::type_name::<O>().to_owned(),
    })
}

impl Hooks {
    /// [`register_full_backward_hook`](Hooks::register_full_backward_hook) on a typed path: the
    /// path is checked at compile time. The hook is not given the module (a backward hook runs
    /// after the call has returned), so its type plays no part.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// #[derive(Module)]
    /// #[module(paths)]
    /// struct Net {
    ///     fc: Linear,
    /// }
    ///
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
    ///         self.fc.call(x)
    ///     }
    /// }
    ///
    /// let net = Net { fc: Linear::new(3, 2, &Device::Cpu)? };
    /// let hooks = Hooks::new();
    /// hooks.register_typed_full_backward_hook(&Net::path().fc(), |ctx, _grad_input, grad_output| {
    ///     assert_eq!((ctx.path(), ctx.class_name()), ("fc", "Linear"));
    ///     assert_eq!(grad_output[0].as_ref().unwrap().dims(), [1, 2]);
    ///     Ok(None)
    /// }, BackwardHookOptions::default())?;
    /// let x = Tensor::ones((1, 3), DType::F32, &Device::Cpu)?;
    /// hooks.run(&net, |m| m.call(&x))?.sum_all()?.backward()?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn register_typed_full_backward_hook<P: TypedPath>(
        &self,
        path: &P,
        hook: impl Fn(
                &BackwardHookCtx<'_>,
                &[Option<Tensor>],
                &[Option<Tensor>],
            ) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> Result<HookHandle> {
        self.register_full_backward_hook(path.as_str(), hook, options)
    }

    /// [`register_full_backward_pre_hook`](Hooks::register_full_backward_pre_hook) on a typed
    /// path, checked at compile time (see
    /// [`register_typed_full_backward_hook`](Hooks::register_typed_full_backward_hook)).
    pub fn register_typed_full_backward_pre_hook<P: TypedPath>(
        &self,
        path: &P,
        hook: impl Fn(&BackwardHookCtx<'_>, &[Option<Tensor>]) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> Result<HookHandle> {
        self.register_full_backward_pre_hook(path.as_str(), hook, options)
    }
}
