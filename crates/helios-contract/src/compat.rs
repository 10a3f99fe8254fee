//! Readers for every execution ABI this engine has shipped.
//!
//! A core is never re-exported because the engine changed. Each ABI's reader resolves the
//! fields that did not exist when that ABI was current to the behavior those cores had.
//!
//! | ABI | added | default for older cores |
//! |-----|-------|-------------------------|
//! | 1   | first release | — |
//! | 2   | `CacheScheme.verification_width` | 1 |
//! | 2   | `CacheScheme.padding_slot` | -1 |
//! | 2   | `Graph.continuation_rows_per_request` | 1 |
//! | 2   | `KernelNode.launch_attributes` | none (an ABI 1 core carrying them is invalid) |
//! | 3   | `GRAPH_KIND_SPECULATIVE` graphs, from which `Capacities.speculative_programs` is derived | none (an ABI 1 or 2 core carrying one is invalid) |
//! | 3   | checkpoint stamps, optional within ABI 3: `VALUE_KIND_CHECKPOINT_EPOCH` on restore and snapshot graphs, `VALUE_KIND_COMPLETION_RECORDS` on state-maintenance graphs (status records) | none: maintenance checks nothing and reports nothing, as before (an ABI 1 or 2 core binding them is invalid; an ABI 3 core without them behaves the same) |
//! | 4   | `Edge.dependency` (programmatic graph edges) | full dependency (an ABI 1–3 core carrying a programmatic edge is invalid) |
//!
//! `Graph.completion_token_capacity`: omitted or zero resolves to
//! [`DEFAULT_COMPLETION_TOKEN_CAPACITY`] in every ABI.

use crate::error::{CoreError, FieldPath, InvalidReason};
use crate::model::{ABI_VERSIONS, DEFAULT_COMPLETION_TOKEN_CAPACITY};

/// The reader selected by a core's `Identity.abi_version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbiReader {
    V1,
    V2,
    V3,
    V4,
}

impl AbiReader {
    pub fn for_version(field: &FieldPath, version: u32) -> Result<Self, CoreError> {
        match version {
            1 => Ok(AbiReader::V1),
            2 => Ok(AbiReader::V2),
            3 => Ok(AbiReader::V3),
            4 => Ok(AbiReader::V4),
            found => Err(CoreError::UnsupportedAbi { field: field.clone(), found, supported: ABI_VERSIONS }),
        }
    }

    pub fn version(self) -> u32 {
        match self {
            AbiReader::V1 => 1,
            AbiReader::V2 => 2,
            AbiReader::V3 => 3,
            AbiReader::V4 => 4,
        }
    }

    pub fn verification_width(self, field: &FieldPath, raw: u32) -> Result<u32, CoreError> {
        match self {
            AbiReader::V1 => Ok(1),
            AbiReader::V2 | AbiReader::V3 | AbiReader::V4 => positive(field, raw),
        }
    }

    pub fn padding_slot(self, field: &FieldPath, raw: i64) -> Result<i64, CoreError> {
        match self {
            AbiReader::V1 => Ok(-1),
            AbiReader::V2 | AbiReader::V3 | AbiReader::V4 if raw < 0 => Ok(raw),
            AbiReader::V2 | AbiReader::V3 | AbiReader::V4 => {
                Err(CoreError::InvalidValue { field: field.clone(), reason: InvalidReason::NotNegative(raw) })
            }
        }
    }

    pub fn continuation_rows_per_request(self, raw: u32) -> u32 {
        match self {
            AbiReader::V1 => 1,
            AbiReader::V2 | AbiReader::V3 | AbiReader::V4 => raw,
        }
    }

    pub fn completion_token_capacity(self, raw: u32) -> u32 {
        if raw == 0 { DEFAULT_COMPLETION_TOKEN_CAPACITY } else { raw }
    }

    /// Whether `KernelNode.launch_attributes` may be present.
    pub fn has_launch_attributes(self) -> bool {
        matches!(self, AbiReader::V2 | AbiReader::V3 | AbiReader::V4)
    }

    /// Whether graphs of kind `GRAPH_KIND_SPECULATIVE` may be present.
    pub fn has_speculative_programs(self) -> bool {
        matches!(self, AbiReader::V3 | AbiReader::V4)
    }

    /// Whether maintenance graphs may bind the checkpoint epoch and status records.
    pub fn has_checkpoint_stamps(self) -> bool {
        matches!(self, AbiReader::V3 | AbiReader::V4)
    }

    /// Whether `Edge.dependency` may be programmatic or launch-order; every edge of an older
    /// core is a full dependency.
    pub fn has_programmatic_edges(self) -> bool {
        matches!(self, AbiReader::V4)
    }
}

fn positive(field: &FieldPath, raw: u32) -> Result<u32, CoreError> {
    if raw == 0 {
        Err(CoreError::InvalidValue { field: field.clone(), reason: InvalidReason::MustBePositive })
    } else {
        Ok(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_abi_has_a_reader() {
        let field = FieldPath::root("abi");
        for &v in ABI_VERSIONS {
            assert_eq!(AbiReader::for_version(&field, v).map(AbiReader::version).ok(), Some(v));
        }
        assert!(matches!(AbiReader::for_version(&field, 5), Err(CoreError::UnsupportedAbi { found: 5, .. })));
        let per_abi = |feature: fn(AbiReader) -> bool| -> Vec<bool> {
            ABI_VERSIONS.iter().filter_map(|&v| AbiReader::for_version(&field, v).ok()).map(feature).collect()
        };
        // Each later ABI keeps every feature of the earlier ones.
        assert_eq!(per_abi(AbiReader::has_launch_attributes), vec![false, true, true, true]);
        assert_eq!(per_abi(AbiReader::has_speculative_programs), vec![false, false, true, true]);
        assert_eq!(per_abi(AbiReader::has_checkpoint_stamps), vec![false, false, true, true]);
        assert_eq!(per_abi(AbiReader::has_programmatic_edges), vec![false, false, false, true]);
    }

    #[test]
    fn later_abis_read_abi2_fields_as_written() {
        let field = FieldPath::root("abi");
        for reader in [AbiReader::V2, AbiReader::V3, AbiReader::V4] {
            assert_eq!(reader.verification_width(&field, 2).ok(), Some(2));
            assert_eq!(reader.padding_slot(&field, -7).ok(), Some(-7));
            assert_eq!(reader.continuation_rows_per_request(3), 3);
        }
        assert_eq!(AbiReader::V1.verification_width(&field, 2).ok(), Some(1));
    }
}
