//! The TP ratio between a local rank and its peer. Kernel block sizes are related through
//! their common unit instead (`units.rs`).

use super::tp::MAX_TP_SIZE;

/// TP ratio from the local side's view: `local/remote` (>= 1) when the local TP is at least the remote TP,
/// `-(remote/local)` otherwise. In pull mode local is decode; in push mode local is prefill.
///
/// # Errors
/// A message naming both sizes when either is zero or over [`MAX_TP_SIZE`], or the larger does not divide by
/// the smaller.
pub fn tp_ratio(local_tp: u32, remote_tp: u32) -> Result<i64, String> {
    if local_tp == 0 || remote_tp == 0 {
        return Err(format!(
            "TP sizes must be positive (local {local_tp}, remote {remote_tp})"
        ));
    }
    if local_tp > MAX_TP_SIZE || remote_tp > MAX_TP_SIZE {
        return Err(format!(
            "TP sizes must be at most {MAX_TP_SIZE} (local {local_tp}, remote {remote_tp})"
        ));
    }
    if local_tp >= remote_tp {
        if local_tp % remote_tp != 0 {
            return Err(format!(
                "local TP {local_tp} is not a multiple of remote TP {remote_tp}"
            ));
        }
        Ok(i64::from(local_tp / remote_tp))
    } else {
        if remote_tp % local_tp != 0 {
            return Err(format!(
                "remote TP {remote_tp} is not a multiple of local TP {local_tp}"
            ));
        }
        Ok(-i64::from(remote_tp / local_tp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_convention() {
        assert_eq!(tp_ratio(4, 2), Ok(2));
        assert_eq!(tp_ratio(2, 8), Ok(-4));
        assert_eq!(tp_ratio(3, 3), Ok(1));
        assert!(tp_ratio(3, 2).unwrap_err().contains("local TP 3"));
        assert!(tp_ratio(2, 3).is_err());
        assert!(tp_ratio(0, 3).is_err());
    }
}
