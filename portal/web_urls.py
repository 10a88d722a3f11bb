from django.contrib.auth import views as auth_views
from django.urls import path

from portal import views

app_name = "portal"
urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="portal/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("invitations/<str:token>/", views.invitation_accept, name="invitation-accept"),
]
