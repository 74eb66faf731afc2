//! Interpreter cfgs for the binding (`Py_GIL_DISABLED`, `PyPy`, `Py_LIMITED_API`, ...), so code that reads
//! CPython objects directly can be compiled out where their layout or locking differs.

fn main() {
    #[cfg(feature = "python")]
    pyo3_build_config::use_pyo3_cfgs();
}
