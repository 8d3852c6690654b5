"""Commands that run other commands whole: ``quickstart`` (SFT, then GRPO) and ``antidistill`` (its stages,
SFT of a student on each trace set). They sit a layer above the recipes, which never import each other."""
