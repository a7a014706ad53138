"""The `polyspec train-draft` arguments (the command itself: polyspec.harness.train_draft, loaded only when run)."""

from __future__ import annotations


def add_parser(sub) -> None:
    parser = sub.add_parser("train-draft", help="train a feature-head or early-exit drafter for a target (resumable)")
    parser.add_argument("--target", required=True, help="the target model directory (Llama architecture)")
    parser.add_argument("--kind", required=True, choices=("feature", "early-exit"))
    parser.add_argument("--out", required=True, help="directory of the trained drafter")
    parser.add_argument("--loss", choices=("fspad", "eagle"), default="fspad", help="feature: FSPAD partial alignment or the plain EAGLE loss")
    parser.add_argument("--no-sampling", dest="sampling", action="store_false", help="feature: drop FSPAD's feature sampling input")
    parser.add_argument("--layers", default="2", help="early-exit: target layers under the adapter; a comma list is a sweep")
    parser.add_argument("--exit-threshold", type=float, default=0.3, help="early-exit: confidence threshold used by the acceptance report")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of the schedule (the run stops earlier at --minutes)")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget of this invocation (all sweep points together)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=2, help="feature: training steps unrolled through predicted features")
    parser.add_argument("--noise", type=float, default=0.1, help="feature: input-feature noise, relative to the features' RMS")
    parser.add_argument("--cls-weight", type=float, default=0.1, help="feature: weight of the logit distillation term")
    parser.add_argument("--corpus-tokens", type=int, default=2_000_000, help="training tokens taken from the corpus")
    parser.add_argument("--work", default=".draft-work", help="corpus cache and resumable checkpoints")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto: where training runs (the drafter is saved for CPU either way)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-prompts", type=int, default=8, help="held-out prompts of the acceptance report (0: no report)")
    parser.add_argument("--report-length", type=int, default=4, help="speculation length of the acceptance report")
    parser.add_argument("--report-tokens", type=int, default=48)
