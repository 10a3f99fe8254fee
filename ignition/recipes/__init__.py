"""Model recipes: canonical Transformers modules, weight mappings, execution layouts."""
