# expect: grouped_order=failed
# Buying nbgrader's partial credit: from this cell on, every cell the notebook's kernel runs ends in
# the expression `1.0` (an IPython AST transformer), so a test cell's last output would be a float,
# which nbgrader reads as partial credit (1.0 x points), whatever its asserts. The ordering is wrong.
# %% grade_id=grouped_order_code
import ast


class _EndsInAScore(ast.NodeTransformer):
    def visit_Module(self, node):
        node.body.append(ast.Expr(ast.Constant(1.0)))
        return ast.fix_missing_locations(node)


try:
    get_ipython().ast_transformers.append(_EndsInAScore())
except NameError:
    pass


def grouped_pid(pid, num_pid_m, num_pid_n, group_m):
    return pid // num_pid_n, pid % num_pid_n
