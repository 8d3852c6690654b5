"""Write examples/data/arith_prompts.csv in the other formats lmforge reads (docs/data.md), so that
each data source has a runnable example without shipping binary files:

    python examples/data/make_sources.py OUT_DIR [--hub-cache CACHE_DIR]

OUT_DIR/arith_prompts.parquet   Parquet
OUT_DIR/arith_prompts.arrow     Arrow (IPC stream, the format of datasets' own cache files)
OUT_DIR/arith_prompts.jsonl     JSON Lines
OUT_DIR/arith_saved/            DatasetDict.save_to_disk with splits train (32 rows) and test (8)
OUT_DIR/arith_dir/              a data directory: train.csv and test.csv (splits from the file names)

--hub-cache CACHE_DIR puts the same two splits into CACHE_DIR as the Hugging Face datasets cache
would hold them after `datasets.load_dataset("local/arith")` on a machine with network access, so the
hub-id path can be tried offline: HF_DATASETS_CACHE=CACHE_DIR lmforge grpo ... data.path=local/arith.
(It builds the cache with datasets' Parquet builder and the cache layout of datasets 5.x; a real
hub dataset gets there by being loaded once with network access.)
"""

import argparse
import csv
import shutil
import tempfile
from pathlib import Path

import datasets
import pyarrow as pa

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hub-cache", type=Path, default=None)
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(HERE / "arith_prompts.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    table = {"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}
    ds = datasets.Dataset.from_dict(table)
    ds.to_parquet(str(out / "arith_prompts.parquet"))
    ds.to_json(str(out / "arith_prompts.jsonl"))
    arrow = pa.table(table)
    with pa.ipc.new_stream(str(out / "arith_prompts.arrow"), arrow.schema) as writer:
        writer.write_table(arrow)
    splits = {"train": ds.select(range(32)), "test": ds.select(range(32, len(ds)))}
    datasets.DatasetDict(splits).save_to_disk(str(out / "arith_saved"))
    (out / "arith_dir").mkdir(exist_ok=True)
    for name, part in splits.items():
        part.to_csv(str(out / "arith_dir" / f"{name}.csv"), index=False)
    if args.hub_cache:
        write_hub_cache(args.hub_cache, "local/arith", splits)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")


def write_hub_cache(cache: Path, repo: str, splits: dict) -> None:
    from datasets.packaged_modules.parquet.parquet import Parquet

    short = repo.split("/")[-1]
    with tempfile.TemporaryDirectory() as scratch:
        files = {}
        for name, part in splits.items():
            files[name] = str(Path(scratch) / f"{name}.parquet")
            part.to_parquet(files[name])
        Parquet(
            cache_dir=str(cache), dataset_name=short, data_files=files, hash="local", config_name="default"
        ).download_and_prepare()
    built = next(p for p in (cache / short).iterdir() if p.is_dir())
    target = cache / repo.replace("/", "___") / "default"
    target.parent.mkdir(parents=True, exist_ok=True)
    built.rename(target)
    shutil.rmtree(cache / short)  # what is left there is lock files


if __name__ == "__main__":
    main()
