//! Errors for bad layouts: each names the offending value and the limit it broke.

/// A rank's layout cannot be turned into a region table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The layout lists no layers.
    #[error("the layout has no layers")]
    NoLayers,
    /// A size that must be positive is zero.
    #[error("{what} must be positive, got 0")]
    Zero {
        /// Which quantity.
        what: String,
    },
    /// The kernel block size does not divide the logical block size.
    #[error("kernel block size {kernel} does not divide logical block size {logical}")]
    KernelBlockNotDividing {
        /// Kernel block size (tokens).
        kernel: u64,
        /// Logical block size (tokens).
        logical: u64,
    },
    /// A page or stride is not divisible by the number of kernel blocks per logical block.
    #[error("layer {layer}: {what} {value} is not divisible by {ppl} kernel blocks per logical block")]
    NotDivisibleByPpl {
        /// Layer name.
        layer: String,
        /// Which quantity ("page", "stride").
        what: String,
        /// Its value in bytes.
        value: u64,
        /// Kernel blocks per logical block.
        ppl: u64,
    },
    /// A tensor does not hold all of its blocks.
    #[error("layer {layer}: tensor of {bytes} bytes is too small for {num_blocks} blocks of {block_len} bytes every {stride} bytes (needs {needed})")]
    TensorTooSmall {
        /// Layer name.
        layer: String,
        /// Tensor bytes.
        bytes: u64,
        /// Blocks it must hold.
        num_blocks: u64,
        /// Bytes per block.
        block_len: u64,
        /// Bytes between blocks.
        stride: u64,
        /// Bytes needed.
        needed: u64,
    },
    /// A block stride smaller than the block it steps over.
    #[error("layer {layer}: block stride {stride} is smaller than the block length {block_len}")]
    StrideTooSmall {
        /// Layer name.
        layer: String,
        /// Stride in bytes.
        stride: u64,
        /// Block length in bytes.
        block_len: u64,
    },
    /// Two distinct regions overlap in memory.
    #[error("region {a} [{a_start:#x}, {a_end:#x}) overlaps region {b} [{b_start:#x}, {b_end:#x})")]
    Overlap {
        /// First region's name.
        a: String,
        /// First region's start.
        a_start: u64,
        /// First region's end.
        a_end: u64,
        /// Second region's name.
        b: String,
        /// Second region's start.
        b_start: u64,
        /// Second region's end.
        b_end: u64,
    },
    /// Address arithmetic would leave the 64-bit address space.
    #[error("{what}: address {addr:#x} + {len} overflows the 64-bit address space")]
    AddressOverflow {
        /// What was being computed.
        what: String,
        /// Base address.
        addr: u64,
        /// Offset added.
        len: u64,
    },
    /// Regions live in different memory types or on different devices.
    #[error(
        "layer {layer} is in {found} but layer {first} is in {expected}; one table holds one memory type and device"
    )]
    MixedMemory {
        /// The layer that differs.
        layer: String,
        /// Its memory type and device.
        found: String,
        /// The first layer.
        first: String,
        /// The first layer's memory type and device.
        expected: String,
    },
    /// An SSM state does not fit in its page.
    #[error("layer {layer}: SSM state of {state} bytes is larger than its page of {page} bytes")]
    StateLargerThanPage {
        /// Layer name.
        layer: String,
        /// Raw state bytes.
        state: u64,
        /// Page bytes.
        page: u64,
    },
    /// Layers sharing one tensor disagree on the kernel page.
    #[error("layers {a} and {b} share base address {base:#x} but their kernel pages differ ({a_len} vs {b_len} bytes every {a_stride} vs {b_stride} bytes)")]
    SharedPageMismatch {
        /// First layer.
        a: String,
        /// Second layer.
        b: String,
        /// Shared base address.
        base: u64,
        /// First layer's kernel page.
        a_len: u64,
        /// Second layer's kernel page.
        b_len: u64,
        /// First layer's kernel stride.
        a_stride: u64,
        /// Second layer's kernel stride.
        b_stride: u64,
    },
    /// Group ids must be dense and each group must hold one kind of layer.
    #[error("{0}")]
    Groups(String),
    /// An SSM spec whose shapes do not give a valid conv split.
    #[error("layer {layer}: {reason}")]
    BadSsmSpec {
        /// Layer name.
        layer: String,
        /// Why the conv split cannot be derived.
        reason: String,
    },
    /// The block size ratio is not a positive divisor.
    #[error("block size ratio {bsr} is invalid: it must be >= 1 and divide every kernel page ({detail})")]
    BadBlockSizeRatio {
        /// Requested ratio.
        bsr: u64,
        /// Which page fails.
        detail: String,
    },
    /// A layout feature hybrid-kv deliberately does not support.
    #[error("not supported: {0}")]
    NotSupported(String),
    /// A page layout the tensors contradict, or one hybrid-kv cannot address.
    #[error("{0}")]
    PageLayout(String),
    /// A layout field that is unknown, misspelled, missing or mistyped (`at` names where: layer and field).
    #[error("{at}: {reason}")]
    BadField {
        /// Where: `layout`, or the layer (name and index) and the part of it (`spec`, `memory`).
        at: String,
        /// What is wrong (serde's words: the unknown key and the expected ones).
        reason: String,
    },
    /// A layer name that is not one of the table's layers (e.g. a stream hook).
    #[error("no layer named {0:?} in this region table")]
    UnknownLayer(String),
}
