//! Builds safetensors files from (name, dtype, shape) lists: data contiguous in list order,
//! filled with a byte pattern, so that the file is valid for the safetensors crate.

/// Bits per element of a dtype name (8 for names the format does not know).
pub fn dtype_bits(dtype: &str) -> u64 {
    crate::common::headers::bits(dtype)
}

/// Bytes of a tensor, or None past `u64` (a file cannot hold it).
pub fn nbytes(dtype: &str, shape: &[u64]) -> Option<u64> {
    let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let bits = n.checked_mul(dtype_bits(dtype))?;
    (bits % 8 == 0).then_some(bits / 8)
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The file for `tensors`, with optional `__metadata__` pairs. Tensors whose size does not fit
/// in bytes are given zero bytes (the file is then invalid, which the caller may want).
pub fn file_of(tensors: &[(String, String, Vec<u64>)], metadata: Option<&[(String, String)]>) -> Vec<u8> {
    file_with_data(tensors, metadata, 0)
}

/// `file_of` with the data bytes drawn from `seed` (so 0-d `.alpha` scalars take varied values).
pub fn file_with_data(
    tensors: &[(String, String, Vec<u64>)],
    metadata: Option<&[(String, String)]>,
    seed: u64,
) -> Vec<u8> {
    let mut members = Vec::new();
    if let Some(pairs) = metadata {
        let body: Vec<String> = pairs
            .iter()
            .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
            .collect();
        members.push(format!("\"__metadata__\":{{{}}}", body.join(",")));
    }
    let mut at = 0u64;
    for (name, dtype, shape) in tensors {
        let size = nbytes(dtype, shape).unwrap_or(0);
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        members.push(format!(
            "{}:{{\"dtype\":{},\"shape\":[{}],\"data_offsets\":[{at},{}]}}",
            json_string(name),
            json_string(dtype),
            dims.join(","),
            at + size
        ));
        at += size;
    }
    let header = format!("{{{}}}", members.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    let mut x = seed | 1;
    file.extend((0..at).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if seed == 0 {
            0
        } else {
            x as u8
        }
    }));
    file
}
