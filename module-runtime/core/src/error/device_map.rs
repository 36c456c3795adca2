//! What can go wrong placing a model by a device map (`dispatch_model`,
//! `infer_auto_device_map`): [`DeviceMapError`], carried by
//! [`Error::DeviceMap`](crate::Error::DeviceMap).

/// A device map that cannot place a model, or a parameter that cannot be placed as asked.
///
/// Each variant names the paths, devices and sizes involved. A map that fails leaves the model
/// as it was: every check runs before the first parameter moves.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceMapError {
    /// Parameters or buffers that no entry of the map places (Accelerate: "The device_map
    /// provided does not give any device for the following parameters").
    #[error(
        "the device map places no device for {}: add an entry for their modules (or `\"\"` for the rest)",
        .paths.join(", ")
    )]
    Uncovered {
        /// The uncovered parameters' and buffers' paths (numbered ones grouped: `layers.{0..3}.weight`).
        paths: Vec<String>,
    },

    /// An entry's device is not a device of this process.
    #[error("device map entry `{pattern}`: device `{name}` is unknown here: {reason}")]
    UnknownDevice {
        /// The entry's pattern.
        pattern: String,
        /// The device as given.
        name: String,
        /// Why (not a device name; a CUDA device in a build without `cuda`; no such GPU).
        reason: String,
    },

    /// One module's parameters would be on two devices: a tied parameter reached through two
    /// modules placed apart, or a module that must not be split (`no_split`) whose parts the map
    /// places apart.
    #[error(
        "`{path}` would be split over two devices: {}; place it whole",
        .placements.iter().map(|(p, d)| format!("`{p}` on {d}")).collect::<Vec<_>>().join(", ")
    )]
    Split {
        /// The module (or tied parameter) that would be split.
        path: String,
        /// The paths involved and the placement each would get.
        placements: Vec<(String, String)>,
    },

    /// `disk` placements without a folder to offload to.
    #[error("device map entry `{pattern}` offloads to disk, but the map has no offload folder (`DeviceMap::offload_folder`)")]
    NoOffloadFolder {
        /// The first entry that places something on disk.
        pattern: String,
    },

    /// A parameter that cannot be offloaded to `cpu` or `disk` (quantized, unbuilt, a
    /// parametrized tensor).
    #[error("`{path}` cannot be offloaded: {reason}")]
    NotOffloadable {
        /// The parameter's path (`parameter` when not known).
        path: String,
        /// What it is.
        reason: String,
    },

    /// `infer_auto_device_map`: a unit larger than what is left on every device, with nowhere
    /// to offload it.
    #[error(
        "`{path}` ({bytes} bytes) fits in no device's budget and the budget has no `cpu` or `disk` to offload it to"
    )]
    NoRoom {
        /// The unit's path.
        path: String,
        /// Its parameters' and buffers' size in bytes.
        bytes: usize,
    },
}
