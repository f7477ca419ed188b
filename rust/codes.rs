//! The stable code lists the core reports: one enum per list, each with `code()` (the string
//! Python, the index and docs/errors.md use), `ALL` in documentation order (exported to Python as
//! `ADAPTER_ERROR_CODES`, `TORCH_ERROR_CODES`, `FORMATS`, ...) and `from_code` for codes read back from Python
//! or an index. The compiler, not a hand-kept list, keeps every code a call site writes listed.

/// A fieldless enum whose variants each stand for one stable string code.
macro_rules! code_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $code:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )*
        }

        impl $name {
            /// Every code, in documentation order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The stable string of this code.
            pub const fn code(self) -> &'static str {
                match self {
                    $( $name::$variant => $code, )*
                }
            }

            /// The code spelled `code`; None for any other text.
            pub fn from_code(code: &str) -> Option<Self> {
                match code {
                    $( $code => Some($name::$variant), )*
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.code())
            }
        }
    };
}

pub(crate) use code_enum;

code_enum! {
    /// The safetensors header rule a file breaks (the code of a [`crate::HeaderError`]).
    pub enum HeaderErrorCode {
        /// The file is shorter than the 8-byte header length.
        HeaderTooSmall = "header_too_small",
        /// The header length exceeds the 100 MB limit.
        HeaderTooLarge = "header_too_large",
        /// The header length runs past the end of the file.
        InvalidHeaderLength = "invalid_header_length",
        /// The header is not UTF-8.
        InvalidUtf8 = "invalid_utf8",
        /// The header is not JSON.
        InvalidJson = "invalid_json",
        /// The header JSON is not an object.
        HeaderNotObject = "header_not_object",
        /// `__metadata__` does not map strings to strings.
        InvalidMetadata = "invalid_metadata",
        /// A tensor entry lacks a field or has one of the wrong type.
        InvalidTensorEntry = "invalid_tensor_entry",
        /// A tensor's dtype has no safetensors name.
        UnknownDtype = "unknown_dtype",
        /// A tensor's data offsets do not follow the previous tensor's.
        InvalidOffset = "invalid_offset",
        /// A shape or byte size overflows 64 bits.
        Overflow = "overflow",
        /// A tensor's size in bits is not a whole number of bytes.
        MisalignedSlice = "misaligned_slice",
        /// A tensor's data offsets span another size than its dtype and shape need.
        TensorSizeMismatch = "tensor_size_mismatch",
        /// The data section is shorter than the tensors need.
        IncompleteBuffer = "incomplete_buffer",
        /// A tensor name appears twice (stricter than the crate).
        DuplicateTensor = "duplicate_tensor",
        /// A key appears twice in one JSON object (stricter than the crate).
        DuplicateKey = "duplicate_key",
    }
}

code_enum! {
    /// Why an adapter failed, besides a header rule or a torch refusal. Remote-only codes come last.
    pub enum AdapterErrorCode {
        /// The path does not exist (or HTTP 404).
        NotFound = "not_found",
        /// The OS (or HTTP 401 / 403) refused access.
        PermissionDenied = "permission_denied",
        /// Any other OS error.
        IoError = "io_error",
        /// The path is no regular file (a FIFO, a device, ...).
        NotRegularFile = "not_regular_file",
        /// A symbolic link whose target does not exist.
        DanglingLink = "dangling_link",
        /// Symbolic links that point at each other.
        SymlinkLoop = "symlink_loop",
        /// A folder holding no adapter.
        NoAdapter = "no_adapter",
        /// A folder holding more than one candidate weights file.
        AmbiguousAdapter = "ambiguous_adapter",
        /// An adapter config with no weights beside it.
        MissingWeights = "missing_weights",
        /// An adapter config that cannot be read.
        InvalidConfig = "invalid_config",
        /// A bug in lorafast (a caught panic, a lost result).
        Internal = "internal",
        /// A remote request timed out.
        Timeout = "timeout",
        /// The connection was refused, reset or aborted.
        ConnectionError = "connection_error",
        /// Another HTTP or network error, after retries.
        RemoteError = "remote_error",
        /// The store returned fewer bytes than asked for.
        ShortRead = "short_read",
        /// The object or file changed while it was being read.
        FileChanged = "file_changed",
        /// An unparseable URL, one with a query string, or an unsupported scheme.
        InvalidUrl = "invalid_url",
        /// The store rejected a storage option.
        StoreConfig = "store_config",
        /// A URL given to a build without the `remote` feature.
        RemoteUnsupported = "remote_unsupported",
    }
}

code_enum! {
    /// Why a torch `.bin` / `.pt` file was refused.
    pub enum TorchErrorCode {
        /// A pre-1.6 file that is not a zip.
        LegacyTorchFormat = "legacy_torch_format",
        /// The zip archive is malformed.
        InvalidZip = "invalid_zip",
        /// `data.pkl` is not a pickle lorafast can interpret.
        InvalidPickle = "invalid_pickle",
        /// The pickle calls something other than the tensor rebuilders.
        UnsafePickle = "unsafe_pickle",
        /// The pickle exceeds a size or depth limit.
        PickleLimit = "pickle_limit",
        /// A tensor past its storage, a missing or short storage record, a storage declared twice
        /// differently or at an unknown location, or a dtype with no safetensors name.
        InvalidTorchTensor = "invalid_torch_tensor",
        /// The pickle is no mapping of names to tensors.
        NotAStateDict = "not_a_state_dict",
        /// Big-endian storage.
        UnsupportedByteorder = "unsupported_byteorder",
    }
}

code_enum! {
    /// One kind of inconsistency found in a readable adapter (`Problem.code`).
    pub enum ProblemCode {
        /// A module has lora_B but no lora_A.
        MissingLoraA = "missing_lora_a",
        /// A module has lora_A but no lora_B.
        MissingLoraB = "missing_lora_b",
        /// A module has no lora_A/lora_B pair (an alpha alone).
        OrphanTensor = "orphan_tensor",
        /// A module has two tensors for the same factor.
        DuplicateFactor = "duplicate_factor",
        /// lora_A's and lora_B's ranks differ.
        RankMismatch = "rank_mismatch",
        /// A factor has another number of dimensions than its module kind reads (a 0-d or 1-d
        /// lora_A on a linear module, a 2-D lora_B on a stacked 3-D one).
        InvalidFactorShape = "invalid_factor_shape",
        /// The tensors' rank differs from the config's `r` / `rank_pattern`.
        ConfigRankMismatch = "config_rank_mismatch",
        /// A module's factors have different dtypes.
        DtypeMismatch = "dtype_mismatch",
        /// The config's target modules and the tensors disagree.
        TargetModulesMismatch = "target_modules_mismatch",
        /// No rule understands a tensor name.
        UnknownTensor = "unknown_tensor",
        /// An alpha value that cannot be read or is no scalar.
        InvalidAlpha = "invalid_alpha",
        /// A stacked MoE lora_A whose rows are no multiple of the configured rank.
        MoeRankNotDivisible = "moe_rank_not_divisible",
        /// A config pattern lorafast cannot evaluate.
        UnsupportedPattern = "unsupported_pattern",
        /// A config field of the wrong type, read as if absent.
        InvalidConfigField = "invalid_config_field",
        /// A tensor entry has a field safetensors does not define (ignored).
        UnknownField = "unknown_field",
        /// A tensor's data offset is no multiple of its element size.
        MisalignedOffset = "misaligned_offset",
        /// A torch file's value that is no tensor.
        NonTensorValue = "non_tensor_value",
        /// Past the per-adapter limit, one entry stands for the rest.
        TooManyProblems = "too_many_problems",
    }
}

code_enum! {
    /// A property of an adapter: bit `i` of the `flags` column is `Flag::ALL[i]`.
    pub enum Flag {
        /// DoRA magnitude vectors.
        Dora = "dora",
        /// LoRA on embeddings.
        Embeddings = "embeddings",
        /// Full copies of modules (`modules_to_save`).
        ModulesToSave = "modules_to_save",
        /// LoRA bias tensors.
        LoraBias = "lora_bias",
        /// PEFT trainable tokens.
        TrainableTokens = "trainable_tokens",
        /// Full weight tensors besides the low-rank factors (saved embeddings, `modules_to_save`).
        FullWeights = "full_weights",
        /// Convolution modules.
        Conv = "conv",
        /// Per-module kohya `.alpha` scalars.
        KohyaAlpha = "kohya_alpha",
        /// A change that is not a plain additive B·A (DoRA, a LyCORIS variant).
        NonAdditive = "non_additive",
        /// The adapter has a config.
        HasConfig = "has_config",
        /// Config keys that make the adapter more than a plain LoRA delta (PiSSA-style init, aLoRA, ...).
        UnsupportedFeatures = "unsupported_features",
    }
}

impl Flag {
    /// This flag's bit in the `flags` column.
    pub const fn bit(self) -> u32 {
        1 << self as u32
    }

    /// The flags set in `bits`, in `ALL` order.
    pub fn set_in(bits: u32) -> impl Iterator<Item = Flag> {
        Flag::ALL.iter().copied().filter(move |f| bits & f.bit() != 0)
    }
}

/// The code of any failed adapter: a header rule, an adapter error or a torch refusal (the three
/// lists share no code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// A header rule.
    Header(HeaderErrorCode),
    /// An adapter error.
    Adapter(AdapterErrorCode),
    /// A torch refusal.
    Torch(TorchErrorCode),
}

impl ErrorCode {
    /// The stable string of this code.
    pub const fn code(self) -> &'static str {
        match self {
            ErrorCode::Header(c) => c.code(),
            ErrorCode::Adapter(c) => c.code(),
            ErrorCode::Torch(c) => c.code(),
        }
    }

    /// The code spelled `code`, from any of the three lists; None for any other text.
    pub fn from_code(code: &str) -> Option<Self> {
        (HeaderErrorCode::from_code(code).map(ErrorCode::Header))
            .or_else(|| AdapterErrorCode::from_code(code).map(ErrorCode::Adapter))
            .or_else(|| TorchErrorCode::from_code(code).map(ErrorCode::Torch))
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

impl From<HeaderErrorCode> for ErrorCode {
    fn from(c: HeaderErrorCode) -> Self {
        ErrorCode::Header(c)
    }
}

impl From<AdapterErrorCode> for ErrorCode {
    fn from(c: AdapterErrorCode) -> Self {
        ErrorCode::Adapter(c)
    }
}

impl From<TorchErrorCode> for ErrorCode {
    fn from(c: TorchErrorCode) -> Self {
        ErrorCode::Torch(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn round_trips<T: Copy + PartialEq + std::fmt::Debug>(
        all: &[T],
        code: fn(T) -> &'static str,
        from: fn(&str) -> Option<T>,
    ) {
        for &c in all {
            assert_eq!(from(code(c)), Some(c), "{c:?}");
        }
        let codes: HashSet<_> = all.iter().map(|&c| code(c)).collect();
        assert_eq!(codes.len(), all.len(), "a code is repeated");
        assert_eq!(from("no_such_code"), None);
    }

    #[test]
    fn every_code_round_trips() {
        round_trips(HeaderErrorCode::ALL, HeaderErrorCode::code, HeaderErrorCode::from_code);
        round_trips(
            AdapterErrorCode::ALL,
            AdapterErrorCode::code,
            AdapterErrorCode::from_code,
        );
        round_trips(TorchErrorCode::ALL, TorchErrorCode::code, TorchErrorCode::from_code);
        round_trips(ProblemCode::ALL, ProblemCode::code, ProblemCode::from_code);
        round_trips(Flag::ALL, Flag::code, Flag::from_code);
    }

    #[test]
    fn error_code_lists_share_no_code() {
        let all: Vec<ErrorCode> = (HeaderErrorCode::ALL.iter().map(|&c| ErrorCode::from(c)))
            .chain(AdapterErrorCode::ALL.iter().map(|&c| c.into()))
            .chain(TorchErrorCode::ALL.iter().map(|&c| c.into()))
            .collect();
        round_trips(&all, ErrorCode::code, ErrorCode::from_code);
    }

    #[test]
    fn flag_bits_follow_all() {
        for (i, f) in Flag::ALL.iter().enumerate() {
            assert_eq!(f.bit(), 1 << i);
        }
        let bits = Flag::Dora.bit() | Flag::HasConfig.bit();
        assert_eq!(Flag::set_in(bits).collect::<Vec<_>>(), [Flag::Dora, Flag::HasConfig]);
    }
}
