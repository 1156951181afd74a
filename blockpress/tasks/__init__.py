"""Task definitions built on the engine (data generation, exact checking, evaluation), e.g. `sudoku`."""
