//! The declarative macros that write a layer family's repeated parts once: the struct of a layer
//! whose fields are all configuration with its constructors (`config_layer!`), a forward pass
//! that maps the input to one tensor (`layer_forward!`), and the by-value forward impls
//! (`forward_by_value!`). Each layer's doc comment, fields and PyTorch name stay at the call
//! site, so rustdoc documents every layer as if it were written out.

/// Implements `Forward<Tensor>` and `candle_core::Module` on top of `Forward<&Tensor>`.
macro_rules! forward_by_value {
    ($($ty:ty),* $(,)?) => {$(
        impl $crate::Forward<candle_core::Tensor> for $ty {
            type Output = candle_core::Tensor;

            fn forward(&self, x: candle_core::Tensor) -> $crate::Result<candle_core::Tensor> {
                self.forward(&x)
            }
        }

        impl candle_core::Module for $ty {
            fn forward(&self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
                Ok($crate::Forward::forward(self, x)?)
            }
        }
    )*};
}
pub(crate) use forward_by_value;

/// A layer whose fields are all configuration: the struct (a derived [`Module`](crate::Module)
/// with typed paths), `Default` (PyTorch's defaults), `new()` and one `with_*`
/// constructor taking every field in order:
///
/// ```text
/// config_layer! {
///     /// The layer's doc.
///     pub struct Ty {
///         /// The field's doc.
///         pub field: type = default,
///     }
///     /// The constructor's doc.
///     with_field
/// }
/// ```
///
/// A layer whose fields have no default gets only the named constructor (`new(field, ..)`): its
/// fields are written without `= default`.
macro_rules! config_layer {
    (
        $(#[$meta:meta])*
        pub struct $ty:ident {
            $($(#[$fmeta:meta])* pub $field:ident: $fty:ty),+ $(,)?
        }
        $(#[$new_meta:meta])* $new:ident
    ) => {
        #[derive(module_derive::Module, Clone, Debug)]
        #[module(crate = module_core)]
        #[module(paths)]
        $(#[$meta])*
        pub struct $ty {
            $($(#[$fmeta])* pub $field: $fty),+
        }

        impl $ty {
            $(#[$new_meta])*
            pub fn $new($($field: $fty),+) -> Self {
                Self { $($field),+ }
            }
        }
    };
    (
        $(#[$meta:meta])*
        pub struct $ty:ident {
            $($(#[$fmeta:meta])* pub $field:ident: $fty:ty = $default:expr),+ $(,)?
        }
        $(#[$with_meta:meta])* $with:ident
    ) => {
        $crate::layer_macros::config_layer! {
            $(#[$meta])*
            pub struct $ty {
                $($(#[$fmeta])* pub $field: $fty),+
            }
            $(#[$with_meta])* $with
        }

        impl Default for $ty {
            fn default() -> Self {
                Self { $($field: $default),+ }
            }
        }

        impl $ty {
            #[doc = concat!("PyTorch's defaults", $(", `", stringify!($field), " = ", stringify!($default), "`"),+, ".")]
            pub fn new() -> Self {
                Self::default()
            }
        }
    };
}
pub(crate) use config_layer;

/// `Forward<In>` with a tensor as output, from a closure-like body:
/// `layer_forward!(Ty, |layer, x| body)` for one input tensor (`&Tensor`),
/// `layer_forward!(Ty, |layer, (a, b)| body)` and `|layer, (a, b, c)|` for two and three
/// (`(&Tensor, &Tensor)`, …), or `layer_forward!(Ty, |layer, pair: (&Tensor, &Tensor)| body)`
/// for another input pattern or type, where
/// `layer` is the layer (`&self`; `_` if the body does not use it). The body returns
/// `Result<Tensor>`.
macro_rules! layer_forward {
    ($ty:ty, |$layer:pat_param, $x:ident| $body:expr) => {
        $crate::layer_macros::layer_forward!($ty, |$layer, $x: &candle_core::Tensor| $body);
    };
    ($ty:ty, |$layer:pat_param, ($a:ident, $b:ident)| $body:expr) => {
        $crate::layer_macros::layer_forward!($ty, |$layer,
                                                   ($a, $b): (
            &candle_core::Tensor,
            &candle_core::Tensor
        )| $body);
    };
    ($ty:ty, |$layer:pat_param, ($a:ident, $b:ident, $c:ident)| $body:expr) => {
        $crate::layer_macros::layer_forward!($ty, |$layer,
                                                   ($a, $b, $c): (
            &candle_core::Tensor,
            &candle_core::Tensor,
            &candle_core::Tensor
        )| $body);
    };
    ($ty:ty, |$layer:pat_param, $x:tt: $in:ty| $body:expr) => {
        impl $crate::Forward<$in> for $ty {
            type Output = candle_core::Tensor;

            fn forward(&self, $x: $in) -> $crate::Result<candle_core::Tensor> {
                let $layer = self;
                $body
            }
        }
    };
}
pub(crate) use layer_forward;

/// A layer without configuration: the struct (a derived [`Module`](crate::Module) with typed
/// paths and a [`Mode`](crate::Mode), which keeps it from being zero-sized and has no effect on
/// the output), `Default` and `new()`:
/// `unit_layer! { /// The layer's doc. pub struct Ty; }`.
macro_rules! unit_layer {
    ($(#[$meta:meta])* pub struct $ty:ident;) => {
        $(#[$meta])*
        #[derive(module_derive::Module, Clone, Debug, Default)]
        #[module(crate = module_core)]
        #[module(paths)]
        pub struct $ty {
            /// Keeps the layer from being zero-sized (see [`ReLU`](crate::ReLU)); no effect on
            /// the output.
            pub mode: $crate::Mode,
        }

        impl $ty {
            /// The layer.
            pub fn new() -> Self {
                Self::default()
            }
        }
    };
}
pub(crate) use unit_layer;

/// The layer's [`ExtraRepr`](module_core::ExtraRepr) (what `print(model)` shows inside its
/// parentheses), for a type marked `#[module(extra_repr)]`: `layer_repr!(Ty, |layer| text)`, or
/// `layer_repr!(Ty: field, ..)` for PyTorch's `field=value, ..` with Python's spelling of the
/// values (`negative_slope=0.01`, `dim=-1`, `inplace=False`).
macro_rules! layer_repr {
    ($ty:ty, |$layer:pat_param| $body:expr) => {
        impl module_core::ExtraRepr for $ty {
            fn extra_repr(&self) -> String {
                let $layer = self;
                $body
            }
        }
    };
    ($ty:ty: $($field:ident),+) => {
        $crate::layer_macros::layer_repr!($ty, |layer| {
            let fields = [$(
                format!("{}={}", stringify!($field), $crate::common::PyValue::py(&layer.$field))
            ),+];
            fields.join(", ")
        });
    };
}
pub(crate) use layer_repr;

/// `Display` as PyTorch's `print(model)` ([`module_repr`](module_core::module_repr)), for a
/// module that implements `Module` by hand (the derive writes it for the others):
/// `display_as_repr!(impl<M: Module> for ModuleList<M>)`.
macro_rules! display_as_repr {
    (impl$(<$g:ident: $bound:path>)? for $ty:ty) => {
        impl$(<$g: $bound>)? std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&module_core::module_repr(self))
            }
        }
    };
}
pub(crate) use display_as_repr;

/// `new()`, the layer with its `Default` (PyTorch's defaults), for a layer that implements
/// `Default` itself: `default_new! { /// The constructor's doc. Ty }`.
macro_rules! default_new {
    ($(#[$meta:meta])* $ty:ident) => {
        impl $ty {
            $(#[$meta])*
            pub fn new() -> Self {
                Self::default()
            }
        }
    };
}
pub(crate) use default_new;
