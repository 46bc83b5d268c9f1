//! What `pinned-bench` records and what it makes of a record: the report (sections of rows,
//! as tables or JSON), the statistics every section uses, and the SVG plot.

pub mod context;
pub mod goals;
pub mod plot;
pub mod report;
pub mod results;
pub mod stats;
