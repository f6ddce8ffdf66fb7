"""``python -m training.memory_plan train.py [key=value ...]``: the memory a run needs, before it loads
(``training/recipes/memory_plan.py``)."""

from training.recipes.memory_plan import main

if __name__ == "__main__":
    main()
