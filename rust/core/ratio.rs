//! TP and block-size ratios between a local rank and its peer (reference C.1).

/// TP ratio from the local side's view: `local/remote` (>= 1) when the local TP is at least the remote TP,
/// `-(remote/local)` otherwise. In pull mode local is decode; in push mode local is prefill.
///
/// # Errors
/// A message naming both sizes when either is zero or the larger does not divide by the smaller.
pub fn tp_ratio(local_tp: u32, remote_tp: u32) -> Result<i64, String> {
    if local_tp == 0 || remote_tp == 0 {
        return Err(format!(
            "TP sizes must be positive (local {local_tp}, remote {remote_tp})"
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

/// Block-size ratio `local_kernel / remote_kernel` (only "remote smaller or equal" is addressable).
///
/// # Errors
/// A message naming both sizes when either is zero or the local block is not a multiple of the remote one.
pub fn block_size_ratio(local_kernel: u64, remote_kernel: u64) -> Result<u64, String> {
    if local_kernel == 0 || remote_kernel == 0 || local_kernel % remote_kernel != 0 {
        return Err(format!(
            "local kernel block size {local_kernel} is not a positive multiple of remote kernel block size {remote_kernel}"
        ));
    }
    Ok(local_kernel / remote_kernel)
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
        assert_eq!(block_size_ratio(16, 4), Ok(4));
        assert!(block_size_ratio(4, 16).is_err());
    }
}
