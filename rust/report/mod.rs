//! A report's bytes: the module table's columns, the Parquet file, the JSON records, and the rows and
//! classifications the persistent index stores.

pub mod index;
pub mod index_chunks;
pub mod module_table;
pub mod parquet;
pub mod records;
