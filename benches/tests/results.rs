//! RESULTS.md and the README's figures are generated from the newest record: regenerating them
//! must give the committed text. And the generator on a small record written by hand.

use std::path::Path;

use pinned_bench::report::{Report, Section, Value};
use pinned_bench::results::{
    Run, listed_records, merged, read_run, readme_block, readme_figures, replace_readme_figures,
    results_md,
};

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn committed_results_match_the_records_they_list() {
    // A test binary run away from its sources (a bundle on a GPU machine) has nothing to
    // compare; the sources' own runs (CI) do compare.
    let Ok(committed) = std::fs::read_to_string(manifest().join("RESULTS.md")) else {
        println!("skipped: no source tree at {}", manifest().display());
        return;
    };
    let names = listed_records(&committed);
    if names.is_empty() {
        println!("RESULTS.md lists no record yet: nothing to compare");
        return;
    }
    let runs: Vec<Run> = names
        .iter()
        .map(|name| read_run(&manifest().join("results").join(name)).unwrap())
        .collect();
    let regenerate = format!(
        "run `cargo run -p pinned-bench -- results {}`",
        names
            .iter()
            .map(|n| format!("benches/results/{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert!(
        committed == results_md(&runs),
        "benches/RESULTS.md differs from what its records give: {regenerate}"
    );
    let readme = std::fs::read_to_string(manifest().join("../README.md")).unwrap();
    let figures = readme_figures(&readme).expect("the README's figures markers");
    assert!(
        figures == readme_block(&merged(&runs)),
        "the README's figures differ from what its records give: {regenerate}"
    );
}

fn fixture() -> Report {
    // Built in, so that the binary runs away from its sources too.
    Report::from_json(include_str!("fixtures/record.json")).unwrap()
}

/// The row of the goals table for `figure`.
fn goal_row<'a>(text: &'a str, figure: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(&format!("| {figure} |")))
        .unwrap_or_else(|| panic!("no row for {figure} in\n{text}"))
}

#[test]
fn the_fixture_reads_back_as_it_was_written() {
    let report = fixture();
    assert_eq!(Report::from_json(&report.to_json()).unwrap(), report);
    assert_eq!(report.commit, "abc1234");
    assert_eq!(report.sections[1].rows[0][2], Value::Num(1.2, 3));
}

#[test]
fn a_met_goal_a_missed_goal_and_a_missing_figure() {
    let text = results_md(&[Run {
        name: "2026-11-26-nvidia-h100-80gb-hbm3-abc1234.json".into(),
        report: fixture(),
    }]);
    assert!(text.lines().count() <= 120, "{text}");
    assert!(
        text.starts_with("# Results: NVIDIA H100 80GB HBM3\n"),
        "{text}"
    );
    assert!(text.contains("- **Commit:** `abc1234`\n"), "{text}");
    assert!(
        text.contains("- **Command:** `pinned-bench pool --record benches/results`\n"),
        "{text}"
    );
    assert!(text.contains("- **Date:** 2026-11-26\n"), "{text}");
    assert!(text.contains("| cpus | 16 |\n"), "{text}");
    assert_eq!(
        goal_row(
            &text,
            "pool pair, `PinnedVec::with_capacity_in(4 KiB, &pool)` + drop"
        ),
        "| pool pair, `PinnedVec::with_capacity_in(4 KiB, &pool)` + drop | PyTorch 200 ns \
         | ≤ 25 ns | 14.2 (13.5–15.6) ns | yes |"
    );
    assert_eq!(
        goal_row(&text, "reserved / requested, mixed sizes"),
        "| reserved / requested, mixed sizes | PyTorch 1.849 | ≤ 1.10 | 1.200 | no |"
    );
    assert!(
        goal_row(&text, "upload of 1 GiB from a `Vec` (`Stager`)").ends_with(
            "| the driver's path: not measured; pinned: not measured | ≥ 50 GB/s | not measured | — |"
        ),
        "{text}"
    );
    assert!(text.contains("](RESULTS.svg)\n"), "{text}");
    let gaps = &text[text.find("## Known gaps").unwrap()..];
    assert!(
        gaps.contains("- reserved / requested, mixed sizes: 1.200 against the goal ≤ 1.10.\n"),
        "{gaps}"
    );
    assert!(!gaps.contains("pool pair"), "{gaps}");
    assert!(gaps.contains("- Not measured in this run: "), "{gaps}");
}

#[test]
fn the_readme_shows_what_was_measured() {
    let block = readme_block(&fixture());
    assert_eq!(
        block,
        "\n| | this workspace | reference |\n|---|---|---|\n\
         | pool pair, `PinnedVec::with_capacity_in(4 KiB, &pool)` + drop | 14.2 (13.5–15.6) ns | PyTorch 200 ns |\n\
         | reserved / requested, mixed sizes | 1.200 | PyTorch 1.849 |\n"
    );
    let readme = "# x\n\n<!-- figures:begin -->\nold\n<!-- figures:end -->\n\nrest\n";
    let replaced = replace_readme_figures(readme, &block).unwrap();
    assert_eq!(readme_figures(&replaced), Some(block.as_str()));
    assert!(replaced.ends_with("<!-- figures:end -->\n\nrest\n"));
    assert_eq!(replace_readme_figures("no markers", &block), None);
}

#[test]
fn the_readme_shows_six_figures_at_most() {
    // Every goal measured: a section per name with every column the goals read, the same
    // figure in every cell.
    let mut report = fixture();
    report.sections.clear();
    for goal in pinned_bench::goals::goals() {
        for read in goal.reads() {
            let columns: Vec<&str> = (read.rows.keys().map(String::as_str))
                .chain(read.columns.names())
                .collect();
            let mut section = Section::new(&read.section, "t", &columns);
            let mut row: Vec<Value> = (read.rows.values())
                .map(|pick| {
                    Value::Text(match pick {
                        pinned_bench::goals::Pick::Is(text) => text.clone(),
                        pinned_bench::goals::Pick::OneOf(list) => list[0].clone(),
                        pinned_bench::goals::Pick::Size(range) => range.from.clone(),
                    })
                })
                .collect();
            row.resize(columns.len(), Value::Num(100.0, 1));
            section.row(row);
            report.sections.push(section);
        }
    }
    let block = readme_block(&report);
    assert_eq!(block.lines().count(), 3 + 6, "{block}");
}

#[test]
fn each_record_names_the_sections_it_gives() {
    let first = fixture();
    let names: Vec<String> = first.sections.iter().map(|s| s.name.clone()).collect();
    assert!(names.len() >= 2, "{names:?}");
    // The second record measured the fixture's first section again, and one of its own.
    let mut second = fixture();
    second.sections.truncate(1);
    second
        .sections
        .push(Section::new("files, several GPUs", "t", &["path"]));
    let text = results_md(&[
        Run {
            name: "first.json".into(),
            report: first,
        },
        Run {
            name: "second.json".into(),
            report: second,
        },
    ]);
    let used: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("  - **Sections used:** "))
        .collect();
    assert_eq!(
        used,
        [
            names[1..].join("; "),
            format!("{}; files, several GPUs", names[0])
        ],
        "{text}"
    );
}

#[test]
fn the_per_core_rows_name_their_cap() {
    use pinned_bench::goals::{
        LOADER_MEMORY_PER_CORE_ROW, LOADER_NPY_PER_CORE_ROW, LOADER_PER_CORE_CAP, goals,
    };
    let cap = format!("(at most {LOADER_PER_CORE_CAP})");
    for name in [LOADER_NPY_PER_CORE_ROW, LOADER_MEMORY_PER_CORE_ROW] {
        assert!(name.contains(&cap), "{name:?} does not say {cap}");
    }
    assert!(
        goals()
            .iter()
            .any(|goal| goal.name.contains("a worker per core") && goal.name.contains(&cap)),
        "the per-core goal does not say {cap}"
    );
}

#[test]
fn the_goals_read_every_row_the_sections_name_for_them() {
    use pinned_bench::goals::*;
    let picked: Vec<&str> = goals()
        .iter()
        .flat_map(Goal::reads)
        .flat_map(|read| read.rows.values())
        .flat_map(|pick| match pick {
            Pick::Is(text) => vec![text.as_str()],
            Pick::OneOf(list) => list.iter().map(String::as_str).collect(),
            Pick::Size(_) => Vec::new(),
        })
        .collect();
    for row in [
        FILES_FIRST_BACK_TO_BACK_ROW,
        FILES_FIRST_SETTLED_ROW,
        FILES_ALLOCATION_BACK_TO_BACK_ROW,
        FILES_ALLOCATION_SETTLED_ROW,
        LOADER_NPY_ROW,
        LOADER_MEMORY_ROW,
        LOADER_NPY_PER_CORE_ROW,
        LOADER_MEMORY_PER_CORE_ROW,
        LOADER_COLD_ROW,
        LOADER_COLD_CEILING_ROW,
        FILES_CEILING_ROW,
        FILES_SHAPE_H2D_ROW,
        FILES_INSTANTTENSOR_WARM_ROW,
        FILES_INSTANTTENSOR_COLD_ROW,
        FILES_FASTSAFETENSORS_WARM_ROW,
        FILES_FASTSAFETENSORS_COLD_ROW,
    ] {
        assert!(picked.contains(&row), "no goal reads the row {row:?}");
    }
}

#[test]
fn goals_are_refused_with_what_is_wrong() {
    use pinned_bench::goals::parse;
    let goal = |extra: &str| {
        format!(
            "[[goal]]\nname = \"n\"\nfigure.section = \"s\"\nfigure.rows.path = \"$none\"\n\
             figure.columns = \"c\"\ndecimals = 1\ngoal = \"g\"\n{extra}"
        )
    };
    assert!(
        parse(&goal(""))
            .unwrap_err()
            .contains("one of at_least and at_most")
    );
    let both = goal("at_least = 1.0\nat_most = 2.0\n");
    assert!(
        parse(&both)
            .unwrap_err()
            .contains("one of at_least and at_most")
    );
    let unlisted = parse(&goal("at_least = 1.0\n")).unwrap_err();
    assert!(unlisted.contains("no list `none`"), "{unlisted}");
    let typo = parse(&goal("at_least = 1.0\nreadem = true\n")).unwrap_err();
    assert!(typo.contains("readem"), "{typo}");
    let size = goal("at_least = 1.0\n").replace("\"$none\"", "{ from = \"16 MB\" }");
    let size = parse(&size).unwrap_err();
    assert!(size.contains("\"16 MB\" is not a size"), "{size}");
}
